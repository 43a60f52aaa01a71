package record

import "vmhost/internal/redact"

// Redactor returns the set of the VM's secret values that no answer may
// carry (docs/api.md, Authentication): the cloud-init password, each
// secret env value, and each secret file's content and each of its lines.
// Exec output, workload logs and console output are redacted through it.
func (s Secrets) Redactor() *redact.Set {
	var vals []string
	if s.Password != "" {
		vals = append(vals, s.Password.Reveal())
	}
	for _, e := range s.SecretEnv {
		vals = append(vals, e.Value.Reveal())
	}
	for _, f := range s.Files {
		c := f.Content.Reveal()
		vals = append(append(vals, c), redact.Lines(c)...)
	}
	return redact.New(vals)
}
