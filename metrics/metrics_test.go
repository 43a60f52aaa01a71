package metrics_test

import (
	"math"
	"strings"
	"testing"

	"vmhost/metrics"
	"vmhost/metrics/metricstest"
)

// TestExposition: HELP and label values are escaped as the format says,
// values print in Go's shortest form, and infinities by name.
func TestExposition(t *testing.T) {
	var w metrics.Writer
	w.Family("vmhost_test_bytes", metrics.Gauge, "A help\nwith a \\ backslash.")
	w.Sample("vmhost_test_bytes", 1.5, "vm_id", `a"b\c`+"\n", "mode", "vm")
	w.Sample("vmhost_test_bytes", math.Inf(1), "vm_id", "x", "mode", "appvm")
	w.Sample("vmhost_test_bytes", 1e21)
	want := `# HELP vmhost_test_bytes A help\nwith a \\ backslash.
# TYPE vmhost_test_bytes gauge
vmhost_test_bytes{vm_id="a\"b\\c\n",mode="vm"} 1.5
vmhost_test_bytes{vm_id="x",mode="appvm"} +Inf
vmhost_test_bytes 1e+21
`
	if got := string(w.Bytes()); got != want {
		t.Fatalf("exposition\n%s\nwant\n%s", got, want)
	}
	metricstest.Check(t, w.Bytes())
}

// TestProcessMetrics: the agent's own metrics are there and pass promtool.
func TestProcessMetrics(t *testing.T) {
	var w metrics.Writer
	metrics.WriteProcess(&w)
	out := string(w.Bytes())
	for _, name := range []string{"process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
		"process_start_time_seconds", "go_goroutines", "go_memstats_heap_alloc_bytes"} {
		if !strings.Contains(out, "\n"+name+" ") {
			t.Errorf("no sample of %s in\n%s", name, out)
		}
	}
	metricstest.Check(t, w.Bytes())
}
