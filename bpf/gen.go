// Package bpf holds the XDP fast path of stunnerd-xdp: the C sources and the Go
// bindings bpf2go generates from them. The generated files are committed so that
// `go build` needs no clang; `make generate` rebuilds them. One bpfel object
// serves every little-endian GOARCH (amd64, arm64, ...); the asm/ headers that
// the kernel's uapi headers include come from include/asm (the BPF target's),
// so generating needs no host-specific include path and gives the same output
// on an x86_64 or an arm64 host.
package bpf

//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -type c2p_key -type c2p_val -type p2c_key -type p2c_val -type p2c_binding -type binding_stats -type binding_state -type alloc_rate -type rate_limit -type next_hop -type dev_cap -type dev_flag -type c2p_flow -type p2c_flow -type reason -type shield -type shield_flag Relay relay.c -- -O2 -g -Wall -Werror -I./include
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel RelayIngress relay_ingress.c -- -O2 -g -Wall -Werror -I./include
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -type group -type flow -type verdict -type slot_info Steer steer.c -- -O2 -g -Wall -Werror -I./include
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -type tc_reason RelayTc relay_tc.c -- -O2 -g -Wall -Werror -I./include
//go:generate go tool bpf2go -cc clang -strip llvm-strip -target bpfel -type charge_args -type charge_verdict Charge charge.c -- -O2 -g -Wall -Werror -I./include
