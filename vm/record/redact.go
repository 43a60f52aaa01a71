package record

import "vmhost/internal/redact"

// Redactor is the set of every secret value the agent knows for the VM:
// the cloud-init password, secret env values, and each secret file's
// content and lines. Workload logs, the console log and exec output pass
// through it (docs/api.md, Secrets).
func (s Secrets) Redactor() *redact.Set {
	var values []string
	if s.Password != "" {
		values = append(values, s.Password.Reveal())
	}
	for _, e := range s.SecretEnv {
		values = append(values, e.Value.Reveal())
	}
	for _, f := range s.Files {
		values = append(values, redact.FileValues(f.Content.Reveal())...)
	}
	return redact.New(values...)
}
