// Package stunner tests stunnerd-xdp as a STUNner dataplane: the binary,
// started as the operator starts a Dataplane, against STUNner v1.2.1's real
// config discovery server (pkg/config/server) and config types (pkg/apis/v1).
package stunner
