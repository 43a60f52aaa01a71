package config

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

func TestDownloadKnobs(t *testing.T) {
	c := Default()
	if c.DownloadIdleSecs != 60 || !reflect.DeepEqual(c.FetchDeny, []string{"169.254.0.0/16", "fe80::/10"}) {
		t.Errorf("Default() download knobs = %d, %q", c.DownloadIdleSecs, c.FetchDeny)
	}
	want := []netip.Prefix{netip.MustParsePrefix("169.254.0.0/16"), netip.MustParsePrefix("fe80::/10")}
	if got := c.FetchDenyPrefixes(); !reflect.DeepEqual(got, want) {
		t.Errorf("FetchDenyPrefixes() = %v, want %v", got, want)
	}
	// Default must not hand out the package's own list.
	c.FetchDeny[0] = "10.0.0.0/8"
	if Default().FetchDeny[0] != "169.254.0.0/16" {
		t.Error("changing one Default() changed the next")
	}

	for _, tc := range []struct {
		body string
		idle int
		deny []string
	}{
		{`{"download_idle_secs": 5, "fetch_deny": ["10.0.0.0/8", "fd00::/8", "192.0.2.1/32"]}`, 5, []string{"10.0.0.0/8", "fd00::/8", "192.0.2.1/32"}},
		{`{"fetch_deny": []}`, 60, []string{}}, // the list is replaced, not merged: [] denies nothing
	} {
		got, err := Parse([]byte(tc.body))
		if err != nil || got.DownloadIdleSecs != tc.idle || !reflect.DeepEqual(got.FetchDeny, tc.deny) {
			t.Errorf("Parse(%s) = %d, %q, %v; want %d, %q", tc.body, got.DownloadIdleSecs, got.FetchDeny, err, tc.idle, tc.deny)
		}
	}

	for _, tc := range []struct{ body, want string }{
		{`{"download_idle_secs": 0}`, "download_idle_secs: 0 is outside 1..86400"},
		{`{"download_idle_secs": 86401}`, "download_idle_secs: 86401 is outside 1..86400"},
		{`{"fetch_deny": ["169.254.169.254"]}`, `fetch_deny[0]: "169.254.169.254" is not a CIDR`},
		{`{"fetch_deny": ["10.0.0.0/8", "10.0.0.0/33"]}`, `fetch_deny[1]: "10.0.0.0/33" is not a CIDR`},
		{`{"fetch_deny": ["10.1.0.0/8"]}`, `fetch_deny[0]: "10.1.0.0/8" has bits set past the prefix length (10.0.0.0/8?)`},
		{`{"fetch_deny": "10.0.0.0/8"}`, "fetch_deny"},
	} {
		_, err := Parse([]byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Parse(%s) = %v, want an error containing %q", tc.body, err, tc.want)
		}
	}
}
