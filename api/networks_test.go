package api

import (
	"os"
	"path/filepath"
	"testing"

	"vmhost/config"
)

// TestNetworksList reads the configured networks with each bridge's state
// from a fake sysfs: a bridge that is up with two ports, a bridge that is
// administratively down, an interface that is not a bridge, and a bridge
// that does not exist.
func TestNetworksList(t *testing.T) {
	h := newHarness(t)
	sys := h.e.SysfsDir
	write := func(rel, content string) {
		t.Helper()
		p := filepath.Join(sys, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	write("class/net/br1/flags", "0x1003\n")
	write("class/net/br1/operstate", "up\n")
	write("class/net/br1/mtu", "9000\n")
	write("class/net/br1/brif/vmtap0/state", "3\n")
	write("class/net/br1/brif/vmtap1/state", "3\n")
	write("class/net/br0/flags", "0x1002\n")
	write("class/net/br0/operstate", "down\n")
	write("class/net/br0/mtu", "1500\n")
	write("class/net/eth0/flags", "0x1003\n")
	write("class/net/eth0/operstate", "up\n")
	write("class/net/eth0/mtu", "1500\n")
	h.e.Config.Networks[1].Isolated = true
	h.e.Config.Networks[1].SpoofGuard = true
	h.e.Config.Networks = append(h.e.Config.Networks,
		config.Network{ID: "quiet", Bridge: "br0"},
		config.Network{ID: "wrong", Bridge: "eth0"},
	)
	h.e.Config.DefaultNetwork = "lab"

	st, _, b := h.do(t, "GET", "/api/networks", h.ro, "")
	want := `{"networks":[` +
		`{"id":"default","bridge":"vmhost0","isolated":false,"spoof_guard":false,"default":false,"bridge_state":{"exists":false,"is_bridge":false,"up":false,"ports":0}},` +
		`{"id":"lab","bridge":"br1","mtu":9000,"isolated":true,"spoof_guard":true,"default":true,"bridge_state":{"exists":true,"is_bridge":true,"up":true,"operstate":"up","mtu":9000,"ports":2}},` +
		`{"id":"quiet","bridge":"br0","isolated":false,"spoof_guard":false,"default":false,"bridge_state":{"exists":true,"is_bridge":true,"up":false,"operstate":"down","mtu":1500,"ports":0}},` +
		`{"id":"wrong","bridge":"eth0","isolated":false,"spoof_guard":false,"default":false,"bridge_state":{"exists":true,"is_bridge":false,"up":true,"operstate":"up","mtu":1500,"ports":0}}` +
		"]}\n"
	if st != 200 || b != want {
		t.Errorf("GET /api/networks = %d\n%s\nwant\n%s", st, b, want)
	}
	// Live: the state follows sysfs from one request to the next.
	write("class/net/br0/flags", "0x1003\n")
	if _, _, b := h.do(t, "GET", "/api/networks", h.ro, ""); b == want {
		t.Error("bringing br0 up did not change the answer")
	}
}

func TestReadBridgeStateRefusesPaths(t *testing.T) {
	sys := t.TempDir()
	if err := os.MkdirAll(filepath.Join(sys, "class", "net", "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"", ".", "..", "../net/x", "a/b"} {
		if st := readBridgeState(sys, name); st.Exists {
			t.Errorf("readBridgeState(%q) = %+v, want nothing read", name, st)
		}
	}
}
