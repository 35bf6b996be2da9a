# stunnerd-xdp container image. The BPF object is generated and committed
# (bpf/*_bpfel.o, embedded by bpf2go's Go files), so the build needs no
# clang: a static Go build is the whole image.
#
#   docker build -t ghcr.io/l7mp/stunnerd-xdp:latest .
FROM golang:1.26 AS build
ARG TARGETARCH
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# test/deploy (TestDockerfile) runs this exact command and checks that the
# binary is static: keep it on one line, without quotes.
RUN CGO_ENABLED=0 GOOS=linux GOARCH=${TARGETARCH} go build -trimpath -o /out/stunnerd-xdp ./cmd/stunnerd-xdp
# STUNner's operator runs a Dataplane's container as `stunnerd`: the image
# answers to that name too (distroless has no shell to link it there).
RUN mkdir /out/bin && mv /out/stunnerd-xdp /out/bin/ && ln -s stunnerd-xdp /out/bin/stunnerd

# distroless/static runs as root by default: loading and attaching XDP needs
# CAP_BPF and CAP_NET_ADMIN, which Kubernetes grants only to a root process
# (the DaemonSet sets runAsUser: 0 and adds exactly those capabilities).
FROM gcr.io/distroless/static-debian12 AS run
# A directory copy keeps the link a link.
COPY --from=build /out/bin/ /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/stunnerd-xdp"]
