package netns

import (
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Metrics is one scrape of a Prometheus text exposition, parsed by expfmt: the metric families
// by name.
type Metrics map[string]*dto.MetricFamily

// ParseMetrics parses a Prometheus text exposition.
func ParseMetrics(r io.Reader) (Metrics, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parsing metrics: %w", err)
	}
	return families, nil
}

// Scrape fetches url (a /metrics endpoint) from inside the namespace and parses it.
func (n *NS) Scrape(url string) (Metrics, error) {
	code, body, err := n.HTTPGet(url)
	if err != nil {
		return nil, err
	}
	if code != http.StatusOK {
		return nil, fmt.Errorf("GET %s: status %d: %.200s", url, code, body)
	}
	return ParseMetrics(strings.NewReader(body))
}

// Sum adds up the samples of the counter or gauge family name whose labels include every
// name, value pair in labels ("iface", "srv0", "mode", "native"); found is false when no
// sample matches.
func (m Metrics) Sum(name string, labels ...string) (sum float64, found bool) {
	f := m[name]
	if f == nil {
		return 0, false
	}
	for _, s := range f.GetMetric() {
		if hasLabels(s, labels) {
			sum += value(s)
			found = true
		}
	}
	return sum, found
}

func hasLabels(s *dto.Metric, labels []string) bool {
	for i := 0; i+1 < len(labels); i += 2 {
		if !slices.ContainsFunc(s.GetLabel(), func(l *dto.LabelPair) bool {
			return l.GetName() == labels[i] && l.GetValue() == labels[i+1]
		}) {
			return false
		}
	}
	return true
}

func value(s *dto.Metric) float64 {
	switch {
	case s.Counter != nil:
		return s.GetCounter().GetValue()
	case s.Gauge != nil:
		return s.GetGauge().GetValue()
	default:
		return s.GetUntyped().GetValue()
	}
}

// Samples returns the counter, gauge and untyped samples keyed as the text exposition writes
// them, name{label="value",...} with the labels in the order they came, for tests and reports
// that name samples the way an operator reads them.
func (m Metrics) Samples() map[string]float64 {
	out := map[string]float64{}
	for name, f := range m {
		for _, s := range f.GetMetric() {
			key := name
			if len(s.GetLabel()) > 0 {
				pairs := make([]string, 0, len(s.GetLabel()))
				for _, l := range s.GetLabel() {
					pairs = append(pairs, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
				}
				key += "{" + strings.Join(pairs, ",") + "}"
			}
			out[key] = value(s)
		}
	}
	return out
}
