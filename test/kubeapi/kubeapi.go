// Package kubeapi runs a real Kubernetes API server for the tests: etcd and
// kube-apiserver v1.35.4 (built from test/kapi, a module of their own) on
// loopback, with RBAC on, fresh data and certificates, and a service-account
// signing key, so that TokenRequest mints ServiceAccount tokens the server
// authenticates and authorizes as it would in a cluster. There is no
// controller-manager, scheduler or kubelet: objects are stored and watched,
// nothing reconciles them (a deleted namespace never finishes terminating, a
// ServiceCIDR's finalizer stays).
package kubeapi

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/test/netns"
)

// Fixed ports inside a namespace of the test's own (nothing else listens
// there); in the test process's namespace free ports are picked instead.
const (
	etcdClientPort = 23790
	etcdPeerPort   = 23800
	securePort     = 16443
)

// readyWithin bounds the start of each server; cold, on a shared 2-core
// machine, /readyz takes ~3 s.
const readyWithin = 60 * time.Second

// Server is an etcd and a kube-apiserver run for one test, on 127.0.0.1 of
// the test process's namespace or of a namespace of the test's.
type Server struct {
	t   testing.TB
	ns  *netns.NS // nil: the test process's own
	dir string

	etcdBin, apiBin        string
	etcdClient, etcdPeer   int
	port                   int
	adminToken, kubeconfig string

	mu   sync.Mutex // guards etcd and api
	etcd *netns.Proc
	api  *netns.Proc
}

// Binaries returns the etcd and kube-apiserver programs, building them from
// test/kapi when bin/ lacks them (~6 min cold, 1.8 GB peak; seconds from the
// Go build cache). A test without them is skipped; under CI=true it fails,
// so that CI cannot pass by skipping the API server tests. Under -short the
// API server tests are skipped (the race run keeps to the fast tests).
func Binaries(t testing.TB) (etcd, apiServer string) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts etcd and kube-apiserver: skipped in -short mode")
	}
	var err error
	if etcd, err = netns.Binary(netns.Etcd); err == nil {
		apiServer, err = netns.Binary(netns.KubeAPIServer)
	}
	if err == nil {
		// Built here, in the parent, for ApplyKustomization in a namespace.
		_, err = netns.Binary(netns.Kustomize)
	}
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("the Kubernetes API server tests cannot run with CI=true: %v", err)
		}
		t.Skipf("no etcd/kube-apiserver (make kube-bins builds them): %v", err)
	}
	return etcd, apiServer
}

// Start starts etcd and the API server in ns (nil: this process's namespace),
// waits for /readyz and stops both when the test ends.
func Start(t testing.TB, ns *netns.NS) *Server {
	t.Helper()
	s := &Server{t: t, ns: ns, dir: t.TempDir(), etcdClient: etcdClientPort, etcdPeer: etcdPeerPort, port: securePort}
	s.etcdBin, s.apiBin = Binaries(t)
	if ns == nil {
		s.etcdClient, s.etcdPeer, s.port = freePort(t), freePort(t), freePort(t)
	}
	s.adminToken = randomHex(t)
	if err := s.writeKeys(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.stopAll)
	if err := s.startEtcd(); err != nil {
		t.Fatal(err)
	}
	if err := s.StartAPIServer(); err != nil {
		t.Fatal(err)
	}
	s.kubeconfig = s.WriteKubeconfig(t, "admin", s.adminToken)
	return s
}

// Addr is the API server's host:port, on loopback in its namespace.
func (s *Server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// AdminKubeconfig is a kubeconfig file for system:masters.
func (s *Server) AdminKubeconfig() string { return s.kubeconfig }

// Admin is a system:masters client for the test's own calls.
func (s *Server) Admin() kubernetes.Interface {
	s.t.Helper()
	return s.client(s.adminToken)
}

func (s *Server) restConfig(token string) *rest.Config {
	cfg := &rest.Config{
		Host:            "https://" + s.Addr(),
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: s.caData()},
		Timeout:         10 * time.Second,
	}
	if s.ns != nil {
		cfg.Dial = s.ns.DialContext
	}
	return cfg
}

func (s *Server) client(token string) kubernetes.Interface {
	c, err := kubernetes.NewForConfig(s.restConfig(token))
	if err != nil {
		s.t.Fatal(err)
	}
	return c
}

// Client is a client authenticated with token (from ServiceAccountToken).
func (s *Server) Client(token string) kubernetes.Interface {
	s.t.Helper()
	return s.client(token)
}

// API is the daemon's own Kubernetes client (internal/kube) authenticated
// with token: what production runs, against this server.
func (s *Server) API(token string) kube.API {
	s.t.Helper()
	c, err := kube.NewForConfig(s.restConfig(token))
	if err != nil {
		s.t.Fatal(err)
	}
	return c
}

// caData is the API server's self-signed serving certificate and its CA, as
// it wrote them into its cert dir.
func (s *Server) caData() []byte {
	b, err := os.ReadFile(filepath.Join(s.dir, "certs", "apiserver.crt"))
	if err != nil {
		s.t.Fatalf("the API server's certificate: %v", err)
	}
	return b
}

// WriteKubeconfig writes a kubeconfig that reaches the server with token as
// user name and returns its path.
func (s *Server) WriteKubeconfig(t testing.TB, name, token string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kapi"] = &clientcmdapi.Cluster{Server: "https://" + s.Addr(), CertificateAuthorityData: s.caData()}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: token}
	cfg.Contexts["kapi"] = &clientcmdapi.Context{Cluster: "kapi", AuthInfo: name}
	cfg.CurrentContext = "kapi"
	path := filepath.Join(t.TempDir(), name+".kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// ServiceAccountToken creates the ServiceAccount namespace/name (and its
// namespace) if missing and mints a token for it with TokenRequest, valid for
// an hour: what the kubelet projects into a pod.
func (s *Server) ServiceAccountToken(t testing.TB, namespace, name string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c := s.Admin()
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	if _, err := c.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	hour := int64(3600)
	tr, err := c.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name,
		&authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &hour}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("TokenRequest for %s/%s: %v", namespace, name, err)
	}
	return tr.Status.Token
}

// StopAPIServer stops the API server (etcd keeps the objects): an API outage.
func (s *Server) StopAPIServer() {
	s.mu.Lock()
	p := s.api
	s.api = nil
	s.mu.Unlock()
	if p != nil {
		_ = p.Stop()
	}
}

// StartAPIServer starts the API server (again, after StopAPIServer) on the
// same port, certificates, keys and etcd, and waits for /readyz.
func (s *Server) StartAPIServer() error {
	p, err := s.launch(s.apiBin,
		"--etcd-servers=http://127.0.0.1:"+strconv.Itoa(s.etcdClient),
		"--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", "--secure-port="+strconv.Itoa(s.port),
		"--cert-dir="+filepath.Join(s.dir, "certs"),
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file="+filepath.Join(s.dir, "sa.pub"),
		"--service-account-signing-key-file="+filepath.Join(s.dir, "sa.key"),
		"--token-auth-file="+filepath.Join(s.dir, "tokens.csv"),
		"--authorization-mode=RBAC",
		"--service-cluster-ip-range=10.96.0.0/16",
	)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.api = p
	s.mu.Unlock()
	if err := s.waitReady(p); err != nil {
		return fmt.Errorf("kube-apiserver: %w\n%s", err, tail(p.Stderr()))
	}
	return nil
}

func (s *Server) startEtcd() error {
	client := "http://127.0.0.1:" + strconv.Itoa(s.etcdClient)
	peer := "http://127.0.0.1:" + strconv.Itoa(s.etcdPeer)
	// --unsafe-no-fsync: the data is the test's and dies with it; fsyncs on a
	// disk shared with the other builds and tests only slow every write.
	p, err := s.launch(s.etcdBin, "--data-dir="+filepath.Join(s.dir, "etcd"),
		"--listen-client-urls="+client, "--advertise-client-urls="+client,
		"--listen-peer-urls="+peer, "--initial-advertise-peer-urls="+peer,
		"--initial-cluster=default="+peer, "--unsafe-no-fsync", "--log-level=warn")
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.etcd = p
	s.mu.Unlock()
	err = netns.Eventually(readyWithin, 100*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("exited: %w", p.Wait(time.Second)))
		}
		code, _, err := s.get(client+"/health", "")
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("/health: %d", code)
		}
		return err
	})
	if err != nil {
		return fmt.Errorf("etcd: %w\n%s", err, tail(p.Stderr()))
	}
	return nil
}

func (s *Server) stopAll() {
	s.StopAPIServer()
	s.mu.Lock()
	p := s.etcd
	s.etcd = nil
	s.mu.Unlock()
	if p != nil {
		_ = p.Stop()
	}
}

// launch starts a server in the namespace; the output is kept for failures.
func (s *Server) launch(bin string, args ...string) (*netns.Proc, error) {
	if s.ns != nil {
		return s.ns.Launch(bin, args...)
	}
	return netns.LaunchCmd(exec.Command(bin, args...))
}

// waitReady waits for the API server's /readyz (all post-start hooks done:
// RBAC bootstrap roles, the default ServiceCIDR).
func (s *Server) waitReady(p *netns.Proc) error {
	return netns.Eventually(readyWithin, 100*time.Millisecond, func() error {
		if p.Exited() {
			return netns.Abort(fmt.Errorf("exited: %w", p.Wait(time.Second)))
		}
		code, body, err := s.get("https://"+s.Addr()+"/readyz", s.adminToken)
		if err == nil && code != http.StatusOK {
			err = fmt.Errorf("/readyz: %d %s", code, body)
		}
		return err
	})
}

// get is a GET from inside the namespace. TLS is not verified here: this only
// polls readiness, before the certificate the clients trust exists.
func (s *Server) get(url, token string) (int, string, error) {
	tr := &http.Transport{DisableKeepAlives: true}
	tr.TLSClientConfig = insecureTLS()
	if s.ns != nil {
		tr.DialContext = s.ns.DialContext
	}
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := (&http.Client{Timeout: 5 * time.Second, Transport: tr}).Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	var b [512]byte
	n, _ := resp.Body.Read(b[:])
	return resp.StatusCode, string(b[:n]), nil
}

// writeKeys writes the service-account signing key pair and the static token
// file that authenticates the admin as system:masters.
func (s *Server) writeKeys() error {
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	files := map[string][]byte{
		"sa.key":     pem.EncodeToMemory(&pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}),
		"sa.pub":     pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}),
		"tokens.csv": fmt.Appendf(nil, "%s,admin,admin-uid,\"system:masters\"\n", s.adminToken),
	}
	for name, b := range files {
		if err := os.WriteFile(filepath.Join(s.dir, name), b, 0o600); err != nil {
			return err
		}
	}
	return nil
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

func randomHex(t testing.TB) string {
	b := make([]byte, 16)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// tail is the end of a server's log, for a failure message.
func tail(s string) string {
	const max = 4000
	if len(s) > max {
		return "..." + s[len(s)-max:]
	}
	return s
}

// insecureTLS is for the readiness probe only (see get).
func insecureTLS() *tls.Config {
	return &tls.Config{InsecureSkipVerify: true} //nolint:gosec // a readiness probe of a test server
}
