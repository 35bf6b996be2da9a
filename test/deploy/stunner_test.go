package deploy_test

import (
	"os"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

// stunnerDir holds the manifests that switch a STUNner Gateway to stunnerd-xdp;
// this file checks them against what the operator does with them and what the
// image holds.
const stunnerDir = "../../deploy/stunner"

// dataplaneSpec is the part of the operator's Dataplane spec (api/v1) these
// manifests set; the fields this test does not name must not be there either.
type dataplaneSpec struct {
	Image                         string                      `json:"image"`
	ImagePullPolicy               corev1.PullPolicy           `json:"imagePullPolicy"`
	Command                       []string                    `json:"command"`
	Args                          []string                    `json:"args"`
	HostNetwork                   bool                        `json:"hostNetwork"`
	TerminationGracePeriodSeconds *int64                      `json:"terminationGracePeriodSeconds"`
	OffloadEngine                 string                      `json:"offloadEngine"`
	EnableMetricsEndpoint         bool                        `json:"enableMetricsEndpoint"`
	Replicas                      *int32                      `json:"replicas"`
	Resources                     corev1.ResourceRequirements `json:"resources"`
	ContainerSecurityContext      *corev1.SecurityContext     `json:"containerSecurityContext"`
}

type dataplane struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec dataplaneSpec `json:"spec"`
}

// The operator's defaults for a Dataplane's container (renderer/dataplane_util.go).
var (
	operatorCommand = []string{"stunnerd"}
	operatorArgs    = []string{"-w", "--udp-thread-num=16"}
)

func TestDataplane(t *testing.T) {
	b, err := os.ReadFile(stunnerDir + "/dataplane.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var d dataplane
	if err := yaml.UnmarshalStrict(b, &d); err != nil {
		t.Fatal(err)
	}
	if d.APIVersion != "stunner.l7mp.io/v1" || d.Kind != "Dataplane" || d.Metadata.Name != "stunnerd-xdp" {
		t.Errorf("object %s %s %s", d.APIVersion, d.Kind, d.Metadata.Name)
	}
	s := d.Spec
	if !slices.Equal(s.Command, operatorCommand) || !slices.Equal(s.Args, operatorArgs) {
		t.Errorf("command %q args %q: want the operator's own, %q %q", s.Command, s.Args, operatorCommand, operatorArgs)
	}
	if !s.HostNetwork || s.TerminationGracePeriodSeconds == nil || *s.TerminationGracePeriodSeconds < 3600 {
		t.Errorf("hostNetwork %v, grace %v", s.HostNetwork, s.TerminationGracePeriodSeconds)
	}
	sc := s.ContainerSecurityContext
	if sc == nil || sc.Capabilities == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Fatalf("containerSecurityContext %+v: XDP needs capabilities, which reach only root", sc)
	}
	if add := slices.Sorted(slices.Values(sc.Capabilities.Add)); !slices.Equal(add, []corev1.Capability{"BPF", "NET_ADMIN", "PERFMON"}) {
		t.Errorf("capabilities added %v, want BPF, NET_ADMIN, PERFMON (test/e2e TestCapabilities)", add)
	}
	if sc.SeccompProfile == nil || sc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault {
		t.Errorf("seccompProfile %+v, want RuntimeDefault", sc.SeccompProfile)
	}
	if !strings.HasPrefix(s.Image, "ghcr.io/l7mp/stunnerd-xdp") {
		t.Errorf("image %s", s.Image)
	}
}

// The image must answer to the operator's command: the Dockerfile links
// stunnerd to the binary, next to it, in a directory on distroless's PATH.
func TestImageAnswersToStunnerd(t *testing.T) {
	b, err := os.ReadFile("../../Dockerfile")
	if err != nil {
		t.Fatal(err)
	}
	f := string(b)
	for _, want := range []string{"ln -s stunnerd-xdp /out/bin/stunnerd", "COPY --from=build /out/bin/ /usr/local/bin/", `ENTRYPOINT ["/usr/local/bin/stunnerd-xdp"]`} {
		if !strings.Contains(f, want) {
			t.Errorf("Dockerfile lacks %q", want)
		}
	}
}

func TestHelmValues(t *testing.T) {
	b, err := os.ReadFile(stunnerDir + "/helm-values.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var v struct {
		StunnerGatewayOperator struct {
			Dataplane struct {
				Mode string `json:"mode"`
				Spec struct {
					Image struct {
						Name, Tag, PullPolicy string
					} `json:"image"`
					Command                       []string                `json:"command"`
					Args                          []string                `json:"args"`
					HostNetwork                   bool                    `json:"hostNetwork"`
					TerminationGracePeriodSeconds int                     `json:"terminationGracePeriodSeconds"`
					EnableMetricsEndpoint         bool                    `json:"enableMetricsEndpoint"`
					ContainerSecurityContext      *corev1.SecurityContext `json:"containerSecurityContext"`
				} `json:"spec"`
			} `json:"dataplane"`
		} `json:"stunnerGatewayOperator"`
	}
	if err := yaml.UnmarshalStrict(b, &v); err != nil {
		t.Fatal(err)
	}
	s := v.StunnerGatewayOperator.Dataplane.Spec
	if !slices.Equal(s.Command, operatorCommand) || !slices.Equal(s.Args, operatorArgs) || !s.HostNetwork ||
		s.Image.Name != "ghcr.io/l7mp/stunnerd-xdp" || v.StunnerGatewayOperator.Dataplane.Mode != "managed" {
		t.Errorf("values %+v", v)
	}
	// Without the capabilities the daemon serves from userspace only.
	sc := s.ContainerSecurityContext
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 || sc.Capabilities == nil {
		t.Fatalf("values: containerSecurityContext %+v, want root with BPF, NET_ADMIN, PERFMON", sc)
	}
	for _, c := range []corev1.Capability{"BPF", "NET_ADMIN", "PERFMON"} {
		if !slices.Contains(sc.Capabilities.Add, c) {
			t.Errorf("values: containerSecurityContext lacks capability %s", c)
		}
	}
}

func TestStunnerRBAC(t *testing.T) {
	b, err := os.ReadFile(stunnerDir + "/rbac.yaml")
	if err != nil {
		t.Fatal(err)
	}
	docs := strings.Split(string(b), "\n---\n")
	if len(docs) != 2 {
		t.Fatalf("%d documents", len(docs))
	}
	var role rbacv1.ClusterRole
	var binding rbacv1.ClusterRoleBinding
	if err := yaml.UnmarshalStrict([]byte(docs[0]), &role); err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict([]byte(docs[1]), &binding); err != nil {
		t.Fatal(err)
	}
	for _, r := range role.Rules {
		for _, v := range r.Verbs {
			if !slices.Contains([]string{"get", "list", "watch"}, v) {
				t.Errorf("verb %s: the daemon only reads", v)
			}
		}
	}
	if binding.RoleRef.Name != role.Name || len(binding.Subjects) != 1 || binding.Subjects[0].Name != "default" {
		t.Errorf("binding %+v", binding)
	}
}
