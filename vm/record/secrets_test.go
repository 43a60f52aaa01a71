package record

import (
	"strings"
	"testing"
)

func TestSecretsRedactor(t *testing.T) {
	s := Secrets{Password: "pw-cloud-init", SecretEnv: []SecretEnv{{Key: "K", Value: "env-value-1"}, {Key: "S", Value: "abc"}},
		Files: []SecretFile{{Path: "/run/key", Content: "line-one-of-key\nline-two\n"}}}
	out := s.Redactor().String("pw-cloud-init env-value-1 abc line-two line-one-of-key")
	if want := "[redacted] [redacted] abc [redacted] [redacted]"; out != want {
		t.Errorf("redacted = %q, want %q", out, want)
	}
	// The file printed without its last newline is one mark.
	if out := s.Redactor().String("<line-one-of-key\nline-two>"); out != "<[redacted]>" {
		t.Errorf("the file without its final newline: %q", out)
	}
	if !(Secrets{}).Redactor().Empty() {
		t.Error("no secrets: the redactor is not empty")
	}
	if strings.Contains(out, "pw-") {
		t.Error("password survived")
	}
}
