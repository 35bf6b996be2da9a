package bpf

// RelayIngressObject is the test build of the XDP program (relay_ingress.c)
// as an object file, for loader.Config.Object: on kernels whose BPF_PROG_RUN
// takes no XDP context it takes the ingress ifindex from in front of the frame.
var RelayIngressObject = _RelayIngressBytes
