package qsdsim

import (
	"reflect"
	"strings"
	"testing"
)

func TestParseOpts(t *testing.T) {
	for _, tc := range []struct {
		in, implied string
		want        map[string]any
	}{
		{"socket,id=qmp,path=/a,,b,server=on", "backend", map[string]any{"backend": "socket", "id": "qmp", "path": "/a,b", "server": "on"}},
		{"type=vhost-user-blk,addr.type=unix,addr.path=/s", "type", map[string]any{"type": "vhost-user-blk", "addr": map[string]any{"type": "unix", "path": "/s"}}},
		{"throttle-group,id=tg,limits.bps-total=5", "qom-type", map[string]any{"qom-type": "throttle-group", "id": "tg", "limits": map[string]any{"bps-total": "5"}}},
		{`{"driver":"qcow2","backing":null}`, "", map[string]any{"driver": "qcow2", "backing": nil}},
	} {
		got, err := parseOpts(tc.in, tc.implied)
		if err != nil || !reflect.DeepEqual(got, tc.want) {
			t.Errorf("parseOpts(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
	if _, err := parseOpts("a=1,junk", ""); err == nil {
		t.Error("parseOpts accepted an element without '='")
	}
}

func TestMergeLimits(t *testing.T) {
	cur := defaultLimits()
	next, err := mergeLimits(cur, map[string]any{"bps-total": float64(100), "iops-total": "7"})
	if err != nil || next["bps-total"] != 100 || next["iops-total"] != 7 || next["bps-total-max-length"] != 1 || len(next) != 19 {
		t.Fatalf("mergeLimits = %v, %v", next, err)
	}
	if cur["bps-total"] != 0 {
		t.Error("mergeLimits changed its input")
	}
	for _, tc := range []struct {
		set  map[string]any
		want string
	}{
		{map[string]any{"bps-read": float64(1)}, "cannot be used at the same time"},
		{map[string]any{"bps-total-max": float64(10)}, "cannot be lower"},
		{map[string]any{"bps-total": float64(-1)}, "must be within"},
		{map[string]any{"bps-totl": float64(1)}, "Parameter 'limits.bps-totl' is unexpected"},
		{map[string]any{"iops-total-max-length": float64(5)}, "burst length set without burst rate"},
	} {
		if _, err := mergeLimits(next, tc.set); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("mergeLimits(%v) = %v, want %q", tc.set, err, tc.want)
		}
	}
}
