package api

import (
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// networkView is one item of GET /api/networks: a host network as the
// configuration defines it, and its bridge as the kernel has it now.
type networkView struct {
	ID          string      `json:"id"`
	Bridge      string      `json:"bridge"`
	MTU         int         `json:"mtu,omitempty"` // configured tap MTU; omitted: host default
	Isolated    bool        `json:"isolated"`
	SpoofGuard  bool        `json:"spoof_guard"`
	Default     bool        `json:"default"`
	BridgeState bridgeState `json:"bridge_state"`
}

// bridgeState is the live state of a bridge, read from sysfs
// (<sysfs>/class/net/<bridge>/) at request time. When the interface does
// not exist only exists (false), is_bridge, up and ports appear.
type bridgeState struct {
	// Exists reports whether an interface of that name exists.
	Exists bool `json:"exists"`
	// IsBridge reports whether it is a bridge (VM taps can join it).
	IsBridge bool `json:"is_bridge"`
	// Up reports the administrative state (IFF_UP in flags).
	Up bool `json:"up"`
	// Operstate is the kernel's RFC 2863 operational state ("up", "down",
	// "lowerlayerdown", "unknown"...); a bridge without running ports is
	// down even when administratively up.
	Operstate string `json:"operstate,omitempty"`
	// MTU is the bridge's current MTU.
	MTU int `json:"mtu,omitempty"`
	// Ports counts the interfaces attached to the bridge.
	Ports int `json:"ports"`
}

type networkList struct {
	Networks []networkView `json:"networks"`
}

// listNetworks answers the configured networks, in configuration order,
// with each bridge's live state.
func (s *Server) listNetworks(w http.ResponseWriter, r *http.Request) {
	cfg := s.vms.Config()
	out := networkList{Networks: []networkView{}}
	for _, n := range cfg.Networks {
		out.Networks = append(out.Networks, networkView{
			ID:          n.ID,
			Bridge:      n.Bridge,
			MTU:         n.MTU,
			Isolated:    n.Isolated,
			SpoofGuard:  n.SpoofGuard,
			Default:     n.ID == cfg.DefaultNetwork,
			BridgeState: readBridgeState(cfg.SysfsRoot, n.Bridge),
		})
	}
	writeJSON(w, http.StatusOK, out)
}

// readBridgeState reads what sysfs says about interface name. Unreadable
// attributes are left at their zero value: the view reports, it does not
// fail.
func readBridgeState(sysfs, name string) bridgeState {
	var st bridgeState
	// A name with a slash or a dot path cannot be an interface; never let
	// it walk sysfs.
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
		return st
	}
	dir := filepath.Join(sysfs, "class", "net", name)
	if _, err := os.Stat(dir); err != nil {
		return st
	}
	st.Exists = true
	if fi, err := os.Stat(filepath.Join(dir, "bridge")); err == nil && fi.IsDir() {
		st.IsBridge = true
	}
	attr := func(a string) string {
		b, err := os.ReadFile(filepath.Join(dir, a))
		if err != nil {
			return ""
		}
		return strings.TrimSpace(string(b))
	}
	if f, err := strconv.ParseUint(strings.TrimPrefix(attr("flags"), "0x"), 16, 32); err == nil {
		st.Up = f&1 != 0 // IFF_UP
	}
	st.Operstate = attr("operstate")
	st.MTU, _ = strconv.Atoi(attr("mtu"))
	if ents, err := os.ReadDir(filepath.Join(dir, "brif")); err == nil {
		st.Ports = len(ents)
	}
	return st
}
