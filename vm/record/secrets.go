package record

import "vmhost/internal/redact"

// Redactor returns the set of the VM's secret values that no answer may
// carry (docs/api.md, Guest operations): the cloud-init password, each
// secret env value, and each secret file's content and each of its lines
// (redact.FileValues). Exec output, workload logs, the console log and an
// exec's argv in the audit log are redacted through it.
func (s Secrets) Redactor() *redact.Set {
	var vals []string
	if s.Password != "" {
		vals = append(vals, s.Password.Reveal())
	}
	for _, e := range s.SecretEnv {
		vals = append(vals, e.Value.Reveal())
	}
	for _, f := range s.Files {
		vals = append(vals, redact.FileValues(f.Content.Reveal())...)
	}
	return redact.New(vals...)
}
