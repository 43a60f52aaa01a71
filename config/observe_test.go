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

func TestRegistryAndCacheKeys(t *testing.T) {
	c := Default()
	if len(c.Registry.Indexes) != 0 || c.Registry.RefreshSecs != 3600 || c.ImageCacheMaxBytes != 0 {
		t.Errorf("Default() = %+v, cache %d", c.Registry, c.ImageCacheMaxBytes)
	}
	got, err := Parse([]byte(`{"registry": {"indexes": ["https://u:secret@mirror.example/streams/v1/index.json", "/srv/images/index.json"], "refresh_secs": 60}, "image_cache_max_bytes": 1073741824}`))
	if err != nil {
		t.Fatal(err)
	}
	if len(got.Registry.Indexes) != 2 || got.Registry.RefreshSecs != 60 || got.ImageCacheMaxBytes != 1<<30 {
		t.Errorf("Parse = %+v, %d", got.Registry, got.ImageCacheMaxBytes)
	}
	for _, tc := range []struct{ body, want string }{
		{`{"registry": {"indexes": ["ftp://u:secret@x/i.json"]}}`, "registry.indexes[0]: must be an http or https URL or an absolute file path"},
		{`{"registry": {"indexes": ["images/index.json"]}}`, "registry.indexes[0]: must be an http or https URL"},
		{`{"registry": {"refresh_secs": 1}}`, "registry.refresh_secs: 1 is outside 10..604800"},
		{`{"image_cache_max_bytes": -1}`, "image_cache_max_bytes: -1 must be 0 (no bound) or positive"},
	} {
		_, err := Parse([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%s) = %v, want an error containing %q", tc.body, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), "secret") {
			t.Errorf("Parse(%s): the error shows the URL's credentials: %v", tc.body, err)
		}
	}
}
