package prefix

import "testing"

func TestParse(t *testing.T) {
	for in, want := range map[string]string{
		"10.0.0.0/8": "10.0.0.0/8", "10.1.2.3": "10.1.2.3/32", "::1": "::1/128",
		"::ffff:10.0.0.0/104": "10.0.0.0/8", "fe80::/10": "fe80::/10", "::ffff:10.1.2.3": "10.1.2.3/32",
	} {
		p, err := Parse(in)
		if err != nil || p.String() != want {
			t.Errorf("Parse(%q) = %v, %v; want %s", in, p, err, want)
		}
	}
	for _, bad := range []string{"10.0.0.1/8", "10.0.0", "example.com", "10.0.0.0/33"} {
		if _, err := Parse(bad); err == nil {
			t.Errorf("Parse(%q): no error", bad)
		}
	}
}
