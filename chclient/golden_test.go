package chclient_test

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// TestVmCreateGolden pins the vm.create body built from a config using every field, so a
// change to what vmhost sends CH shows up in review.
func TestVmCreateGolden(t *testing.T) {
	f := fixture{dir: "/run/vmhost/vms/vm1", sock: "/run/vmhost/vms/vm1/ch.sock", vsock: "/run/vmhost/vms/vm1/vsock.sock",
		serial: "/run/vmhost/vms/vm1/console.sock"}
	got, err := json.MarshalIndent(fullConfig(f), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	const golden = "testdata/vm-create-full.golden"
	if *update {
		if err := os.WriteFile(golden, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("vm.create body differs from %s (run with -update if intended):\n%s", golden, got)
	}
}
