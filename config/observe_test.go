package config

import (
	"strings"
	"testing"
)

func TestTLSAndObservabilityKeys(t *testing.T) {
	c := Default()
	if c.AuditLogMaxBytes != 64<<20 || c.EventsKeep != 10_000 || c.TLS != (TLS{}) {
		t.Errorf("Default() = audit %d, events %d, tls %+v", c.AuditLogMaxBytes, c.EventsKeep, c.TLS)
	}
	got, err := Parse([]byte(`{"tls": {"cert": "/etc/vmhost/cert.pem", "key": "/etc/vmhost/key.pem", "client_ca": "/etc/vmhost/ca.pem"}, "audit_log_max_bytes": 8192, "events_keep": 20000}`))
	if err != nil {
		t.Fatal(err)
	}
	if want := (TLS{"/etc/vmhost/cert.pem", "/etc/vmhost/key.pem", "/etc/vmhost/ca.pem"}); got.TLS != want || got.AuditLogMaxBytes != 8192 || got.EventsKeep != 20000 {
		t.Errorf("Parse = %+v, %d, %d", got.TLS, got.AuditLogMaxBytes, got.EventsKeep)
	}
	for _, tc := range []struct{ body, want string }{
		{`{"tls": {"cert": "/c.pem"}}`, "tls: cert and key go together"},
		{`{"tls": {"key": "/k.pem"}}`, "tls: cert and key go together"},
		{`{"tls": {"cert": "c.pem", "key": "/k.pem"}}`, `tls.cert: "c.pem" must be an absolute path`},
		{`{"tls": {"client_ca": "/ca.pem"}}`, "tls.client_ca: set without tls.cert and tls.key"},
		{`{"audit_log_max_bytes": 100}`, "audit_log_max_bytes: 100 must be at least 4096"},
		{`{"events_keep": 10}`, "events_keep: 10 must be at least 10000"},
	} {
		_, err := Parse([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%s) = %v, want an error containing %q", tc.body, err, tc.want)
		}
	}
}
