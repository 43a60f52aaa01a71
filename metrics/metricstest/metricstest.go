// Package metricstest checks an exposition with Prometheus's own linter,
// promtool check metrics (Debian package prometheus).
package metricstest

import (
	"bytes"
	"os"
	"os/exec"
	"testing"
)

// Check fails t when promtool check metrics finds a problem in data. A
// missing promtool skips t, or fails it under CI (the CI environment
// variable set): CI must run the real linter.
func Check(t testing.TB, data []byte) {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		const why = "promtool is not installed (apt-get install --no-install-recommends prometheus); the exposition was not linted"
		if os.Getenv("CI") != "" {
			t.Fatal(why + ", and CI is set: CI must not skip it")
		}
		t.Skip(why)
	}
	cmd := exec.Command(p, "check", "metrics")
	cmd.Stdin = bytes.NewReader(data)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("promtool check metrics: %v\n%s\nexposition:\n%s", err, out, data)
	}
}
