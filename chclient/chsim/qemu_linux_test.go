package chsim

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestKVMDetection(t *testing.T) {
	for _, tc := range []struct {
		name    string
		files   []string
		want    bool
		because string
	}{
		{"no /dev/kvm", []string{"sys/module/kvm_intel/x"}, false, "no usable /dev/kvm"},
		{"PVM", []string{"dev/kvm", "sys/module/kvm_pvm/x", "sys/module/kvm_intel/x"}, false, "PVM"},
		{"intel", []string{"dev/kvm", "sys/module/kvm_intel/x"}, true, "kvm_intel"},
		{"amd", []string{"dev/kvm", "sys/module/kvm_amd/x"}, true, "kvm_amd"},
		{"unknown", []string{"dev/kvm"}, false, "neither"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			for _, f := range tc.files {
				p := filepath.Join(root, f)
				os.MkdirAll(filepath.Dir(p), 0o755)
				if err := os.WriteFile(p, nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			ok, why := kvmBootsStockKernelsAt(root)
			if ok != tc.want || !strings.Contains(why, tc.because) {
				t.Errorf("= %v (%s), want %v (%s)", ok, why, tc.want, tc.because)
			}
		})
	}
	if got, _, err := resolveAccel("tcg"); err != nil || got != "tcg" {
		t.Errorf("resolveAccel(tcg) = %s, %v", got, err)
	}
	if _, _, err := resolveAccel("hvf"); err == nil {
		t.Error("resolveAccel(hvf) accepted")
	}
}
