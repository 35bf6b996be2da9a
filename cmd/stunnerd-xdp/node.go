package main

import (
	"fmt"
	"time"

	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/l7mp/stunnerd-xdp/internal/daemon"
	"github.com/l7mp/stunnerd-xdp/internal/kube"
	"github.com/l7mp/stunnerd-xdp/internal/logging"
)

// nodeListWait is how long the start waits for the Kubernetes API before it
// goes on without the node label (the daemon serves all the while).
const nodeListWait = 3 * time.Second

// watchNode connects to the Kubernetes API (in-cluster, or a kubeconfig) and
// makes the daemon follow its node's offload label. Patient, an API server
// that does not answer is waited for in the background (see
// daemon.WatchNodePatiently); otherwise it is given up on after 30 s.
func watchNode(d *daemon.Daemon, logger *logging.Factory, node, kubeconfig string, patient bool) error {
	// client-go logs through klog: keep those lines in our format and scope.
	klog.SetSlogLogger(logger.Slog("k8s"))
	var (
		cfg *rest.Config
		err error
	)
	if kubeconfig != "" {
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		cfg, err = rest.InClusterConfig()
	}
	if err != nil {
		return fmt.Errorf("client config for the Kubernetes API: %w", err)
	}
	client, err := kube.NewForConfig(cfg)
	if err != nil {
		return fmt.Errorf("client for the Kubernetes API: %w", err)
	}
	if patient {
		return d.WatchNodePatiently(client, node, nodeListWait)
	}
	return d.WatchNode(client, node, 30*time.Second)
}
