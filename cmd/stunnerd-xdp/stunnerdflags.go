package main

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	flag "github.com/spf13/pflag"
)

// stunnerdDefaultOrigin is where stunnerd loads its config from when neither
// -c, $STUNNER_CONFIG_ORIGIN nor a TURN URI says (stunnerd's
// DefaultConfigDiscoveryAddress): the config discovery service on this host.
const stunnerdDefaultOrigin = ":13478"

// k8sFlags are the Kubernetes client flags stunnerd takes from
// k8s.io/cli-runtime (for `-c k8s`: finding the config discovery pod through
// the API and port-forwarding to it). They are accepted, so that a command
// line written for stunnerd starts, and ignored with a warning: this daemon
// runs in the cluster and is given the discovery service's address.
var k8sFlags = []struct {
	name, short string
	bool, array bool
}{
	{name: "cache-dir"}, {name: "client-certificate"}, {name: "client-key"}, {name: "token"},
	{name: "as"}, {name: "as-uid"}, {name: "as-group", array: true}, {name: "as-user-extra", array: true},
	{name: "username"}, {name: "password"}, {name: "cluster"}, {name: "user"}, {name: "namespace", short: "n"},
	{name: "context"}, {name: "server", short: "s"}, {name: "tls-server-name"},
	{name: "insecure-skip-tls-verify", bool: true}, {name: "certificate-authority"}, {name: "request-timeout"},
	{name: "disable-compression", bool: true},
}

// cdsOptions are how the config discovery service is found and trusted.
type cdsOptions struct {
	// stunnerd's (pkg/config/client CDSConfigFlags): the server's address
	// and port, for `-c k8s` (default: $CDS_SERVER_ADDR, $CDS_SERVER_PORT,
	// $CDS_SERVER_NAMESPACE).
	serverAddr, serverNamespace string
	serverPort                  int
	// This project's: a CA bundle to verify an https/wss server with (in
	// place of the system roots), and a client certificate to present.
	ca, cert, key string
}

// addStunnerdFlags declares stunnerd's Kubernetes and config discovery flags
// and the config discovery client's TLS flags.
func addStunnerdFlags(fs *flag.FlagSet, o *options) {
	port := 13478
	if p, err := strconv.Atoi(os.Getenv("CDS_SERVER_PORT")); err == nil {
		port = p
	}
	fs.StringVar(&o.cds.serverAddr, "cds-server-address", os.Getenv("CDS_SERVER_ADDR"),
		"config discovery service `ADDRESS` for -c k8s (stunnerd's flag; default: $CDS_SERVER_ADDR): -c k8s then means ADDRESS:PORT")
	fs.StringVar(&o.cds.serverNamespace, "cds-server-namespace", os.Getenv("CDS_SERVER_NAMESPACE"),
		"stunnerd's flag for finding the discovery pod through the Kubernetes API: accepted, not used (default: $CDS_SERVER_NAMESPACE)")
	fs.IntVar(&o.cds.serverPort, "cds-server-port", port, "config discovery service `PORT` for -c k8s with --cds-server-address (default: $CDS_SERVER_PORT, else 13478)")
	fs.StringVar(&o.cds.ca, "cds-ca", "", "PEM `FILE` of the CA(s) that sign an https/wss config discovery server's certificate (in place of the system's)")
	fs.StringVar(&o.cds.cert, "cds-cert", "", "PEM `FILE` of the client certificate presented to an https/wss config discovery server (with --cds-key)")
	fs.StringVar(&o.cds.key, "cds-key", "", "PEM `FILE` of the key of --cds-cert")
	for _, f := range k8sFlags {
		switch {
		case f.bool:
			fs.BoolP(f.name, f.short, false, "")
		case f.array:
			fs.StringArrayP(f.name, f.short, nil, "")
		default:
			fs.StringP(f.name, f.short, "", "")
		}
		_ = fs.MarkHidden(f.name)
	}
}

// ignoredK8sFlags names the Kubernetes client flags given (never their
// values: --password and --token are secrets).
func ignoredK8sFlags(fs *flag.FlagSet) []string {
	var out []string
	for _, f := range k8sFlags {
		if fs.Changed(f.name) {
			out = append(out, "--"+f.name)
		}
	}
	return out
}

// k8sOrigin is what stunnerd makes of `-c k8s` with a config discovery
// address given (--cds-server-address or $CDS_SERVER_ADDR): ADDRESS:PORT, no
// discovery; without one, "k8s" stays and parseOrigin explains why it is
// refused.
func k8sOrigin(c cdsOptions) (string, error) {
	if c.serverAddr == "" {
		return "k8s", nil
	}
	if c.serverPort < 1 || c.serverPort > 65535 {
		return "", fmt.Errorf("%w: --cds-server-port %d: want 1-65535", errUsage, c.serverPort)
	}
	host := c.serverAddr
	if strings.Contains(host, "://") {
		return host, nil // a URL: stunnerd would append the port; a URL has its own
	}
	return net.JoinHostPort(host, strconv.Itoa(c.serverPort)), nil
}
