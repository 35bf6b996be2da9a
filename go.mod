module github.com/l7mp/stunnerd-xdp

go 1.26.8

require (
	github.com/cilium/ebpf v0.22.0
	github.com/pion/logging v0.2.4
	github.com/vishvananda/netlink v1.3.1
	github.com/vishvananda/netns v0.0.5
	golang.org/x/sys v0.50.0
)

require (
	github.com/stretchr/testify v1.12.0 // indirect
	golang.org/x/net v0.59.0 // indirect
)

tool github.com/cilium/ebpf/cmd/bpf2go
