// Command render prints the objects a kustomization renders, as YAML
// documents, the way `kubectl kustomize DIR` does. test/kubeapi applies what
// it prints to a real API server; being a program of this module, it keeps
// kustomize out of the main module.
package main

import (
	"fmt"
	"os"

	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: render KUSTOMIZATION_DIR")
		os.Exit(2)
	}
	resMap, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), os.Args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "kustomize %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	out, err := resMap.AsYaml()
	if err != nil {
		fmt.Fprintf(os.Stderr, "kustomize %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	if _, err := os.Stdout.Write(out); err != nil {
		os.Exit(1)
	}
}
