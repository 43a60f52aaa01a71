package seed

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// cloudInit returns the path of the cloud-init command, or skips t when it
// is not installed. Under CI (the CI environment variable set) a missing
// cloud-init fails the test instead: CI must check the real renderers.
func cloudInit(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("cloud-init")
	if err == nil {
		return p
	}
	const why = "cloud-init is not installed (apt-get install --no-install-recommends cloud-init); the default-route check against its renderers did not run"
	if os.Getenv("CI") != "" {
		t.Fatal(why + ", and CI is set: CI must not skip it")
	}
	t.Skip(why)
	return ""
}

// route is one default route found in a renderer's output: the interface
// it leaves by, the family ("inet" or "inet6") and the next hop.
type route struct{ ifname, family, via string }

// renderers are cloud-init's output kinds with a distro that selects them.
// The sysconfig renderer is checked with the RHEL flavour: its SUSE flavour
// writes no default route in any form (seed package doc).
var renderers = []struct {
	kind, distro string
	routes       func(t *testing.T, out string) []route
	dhcp4        func(t *testing.T, out, ifname string) bool
}{
	{"eni", "debian", eniRoutes, eniDHCP4},
	{"netplan", "ubuntu", netplanRoutes, netplanDHCP4},
	{"networkd", "debian", networkdRoutes, networkdDHCP4},
	{"sysconfig", "rhel", sysconfigRoutes, sysconfigDHCP4},
	{"network-manager", "fedora", nmRoutes, nmDHCP4},
}

// TestNetConvertDefaultRoute renders seeds with static gateways and runs
// `cloud-init devel net-convert` on their network-config for every
// renderer cloud-init has: each must produce exactly the expected default
// routes, on the right interface, as something the guest applies without
// extra tools (eni's "post-up route add" needs net-tools and does not
// count), and DHCP interfaces must stay DHCP.
func TestNetConvertDefaultRoute(t *testing.T) {
	ci := cloudInit(t)
	cases := []struct {
		name string
		ifcs []Interface
		want []route
		dhcp []string // interfaces expected to use DHCPv4
	}{
		{"static-v4", []Interface{
			{MAC: "02:00:00:00:01:01", IPv4: &Address{Address: "192.0.2.10/24", Gateway: "192.0.2.1", DNS: []string{"192.0.2.53"}}},
		}, []route{{"eth0", "inet", "192.0.2.1"}}, nil},
		{"static-v6", []Interface{
			{MAC: "02:00:00:00:02:01", IPv4: &Address{Address: "192.0.2.10/24"}, IPv6: &Address{Address: "2001:db8:10::10/64", Gateway: "2001:db8:10::1"}},
		}, []route{{"eth0", "inet6", "2001:db8:10::1"}}, nil},
		{"multi-nic", []Interface{
			{MAC: "02:00:00:00:03:01"},
			{MAC: "02:00:00:00:03:02", IPv4: &Address{Address: "198.51.100.5/25", Gateway: "198.51.100.1"}},
			{Name: "backend", MAC: "02:00:00:00:03:03",
				IPv4: &Address{Address: "10.1.0.5/16"},
				IPv6: &Address{Address: "2001:db8:20::5/64", Gateway: "2001:db8:20::1", DNS: []string{"2001:db8:20::53"}}},
		}, []route{{"eth1", "inet", "198.51.100.1"}, {"backend", "inet6", "2001:db8:20::1"}}, []string{"eth0"}},
	}
	for _, tc := range cases {
		f, err := Render(Config{InstanceID: "iid-vm-" + tc.name, Hostname: "vm-" + tc.name, User: "root", Interfaces: tc.ifcs})
		if err != nil {
			t.Fatalf("%s: Render: %v", tc.name, err)
		}
		in := filepath.Join(t.TempDir(), NetworkConfigName)
		if err := os.WriteFile(in, f.NetworkConfig, 0o644); err != nil {
			t.Fatal(err)
		}
		for _, r := range renderers {
			t.Run(tc.name+"/"+r.kind, func(t *testing.T) {
				if r.kind == "networkd" && os.Geteuid() != 0 {
					t.Skip("cloud-init's networkd renderer chowns what it writes to systemd-network, which needs root: run go test as root")
				}
				t.Parallel() // each net-convert is a ~1 s Python start
				out := t.TempDir()
				cmd := exec.Command(ci, "devel", "net-convert", "-p", in, "-k", "yaml", "-D", r.distro, "-O", r.kind, "-d", out)
				if msg, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("%s: %v\n%s", cmd, err, msg)
				}
				got := r.routes(t, out)
				sortRoutes(got)
				want := slices.Clone(tc.want)
				sortRoutes(want)
				if !slices.Equal(got, want) {
					t.Errorf("default routes %v, want %v\nnetwork-config:\n%s\nrendered:\n%s", got, want, f.NetworkConfig, dumpTree(t, out))
				}
				for _, name := range tc.dhcp {
					if !r.dhcp4(t, out, name) {
						t.Errorf("%s is not DHCPv4 in the %s output:\n%s", name, r.kind, dumpTree(t, out))
					}
				}
			})
		}
	}
}

func sortRoutes(rs []route) {
	slices.SortFunc(rs, func(a, b route) int { return strings.Compare(fmt.Sprint(a), fmt.Sprint(b)) })
}

func dumpTree(t *testing.T, dir string) string {
	var b strings.Builder
	filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			data, _ := os.ReadFile(p)
			fmt.Fprintf(&b, "--- %s\n%s", strings.TrimPrefix(p, dir), data)
		}
		return nil
	})
	return b.String()
}

func readRendered(t *testing.T, path string) string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading rendered output: %v", err)
	}
	return string(data)
}

// familyOf returns "inet6" for an IPv6 address and "inet" otherwise.
func familyOf(addr string) string {
	if strings.Contains(addr, ":") {
		return "inet6"
	}
	return "inet"
}

// eniRoutes reads /etc/network/interfaces.d/50-cloud-init: a default route
// is a "gateway G" option in an "iface NAME inet|inet6 static" stanza,
// which ifupdown applies with iproute2.
func eniRoutes(t *testing.T, out string) []route {
	var rs []route
	var ifname, family string
	sc := bufio.NewScanner(strings.NewReader(readRendered(t, filepath.Join(out, "etc/network/interfaces.d/50-cloud-init"))))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch {
		case len(f) >= 3 && f[0] == "iface":
			ifname, family = f[1], f[2]
		case len(f) == 2 && f[0] == "gateway" && ifname != "":
			rs = append(rs, route{ifname, family, f[1]})
		}
	}
	return rs
}

func eniDHCP4(t *testing.T, out, ifname string) bool {
	return strings.Contains(readRendered(t, filepath.Join(out, "etc/network/interfaces.d/50-cloud-init")), "\niface "+ifname+" inet dhcp\n")
}

// netplanDoc parses /etc/netplan/50-cloud-init.yaml with PyYAML (a
// dependency of cloud-init) and returns network.ethernets.
func netplanDoc(t *testing.T, out string) map[string]map[string]any {
	t.Helper()
	cmd := exec.Command("python3", "-c", "import sys, json, yaml; json.dump(yaml.safe_load(open(sys.argv[1])), sys.stdout)",
		filepath.Join(out, "etc/netplan/50-cloud-init.yaml"))
	data, err := cmd.Output()
	if err != nil {
		t.Fatalf("parsing the netplan output: %v", err)
	}
	var doc struct {
		Network struct {
			Ethernets map[string]map[string]any `json:"ethernets"`
		} `json:"network"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	return doc.Network.Ethernets
}

// netplanRoutes: gateway4 / gateway6, or a route to 0.0.0.0/0, ::/0 or
// default, all of which netplan turns into a default route.
func netplanRoutes(t *testing.T, out string) []route {
	var rs []route
	for name, e := range netplanDoc(t, out) {
		for _, k := range []string{"gateway4", "gateway6"} {
			if g, ok := e[k].(string); ok {
				rs = append(rs, route{name, familyOf(g), g})
			}
		}
		routes, _ := e["routes"].([]any)
		for _, r := range routes {
			m, _ := r.(map[string]any)
			to, _ := m["to"].(string)
			via, _ := m["via"].(string)
			if to == "0.0.0.0/0" || to == "::/0" || to == "default" {
				rs = append(rs, route{name, familyOf(via), via})
			}
		}
	}
	return rs
}

func netplanDHCP4(t *testing.T, out, ifname string) bool {
	return netplanDoc(t, out)[ifname]["dhcp4"] == true
}

// iniSections splits a systemd-networkd or NetworkManager key file into
// its sections, in order, as name and key=value pairs.
func iniSections(text string) []struct {
	name string
	kv   map[string]string
} {
	var secs []struct {
		name string
		kv   map[string]string
	}
	for _, line := range strings.Split(text, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, "[") && strings.HasSuffix(line, "]") {
			secs = append(secs, struct {
				name string
				kv   map[string]string
			}{line[1 : len(line)-1], map[string]string{}})
		} else if k, v, ok := strings.Cut(line, "="); ok && len(secs) > 0 {
			secs[len(secs)-1].kv[strings.TrimSpace(k)] = strings.TrimSpace(v)
		}
	}
	return secs
}

// networkdRoutes: a [Route] section with Gateway= and no Destination= or a
// Destination= of 0.0.0.0/0 or ::/0, in 10-cloud-init-NAME.network.
func networkdRoutes(t *testing.T, out string) []route {
	files, _ := filepath.Glob(filepath.Join(out, "etc/systemd/network/10-cloud-init-*.network"))
	var rs []route
	for _, p := range files {
		name := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "10-cloud-init-"), ".network")
		for _, s := range iniSections(readRendered(t, p)) {
			g := s.kv["Gateway"]
			if d := s.kv["Destination"]; s.name != "Route" || g == "" || d != "" && d != "0.0.0.0/0" && d != "::/0" {
				continue
			}
			rs = append(rs, route{name, familyOf(g), g})
		}
	}
	return rs
}

func networkdDHCP4(t *testing.T, out, ifname string) bool {
	for _, s := range iniSections(readRendered(t, filepath.Join(out, "etc/systemd/network/10-cloud-init-"+ifname+".network"))) {
		if d := s.kv["DHCP"]; s.name == "Network" && (d == "ipv4" || d == "yes") {
			return true
		}
	}
	return false
}

// sysconfigRoutes: GATEWAY= and IPV6_DEFAULTGW= in ifcfg-NAME, plus
// "default via G" or "0.0.0.0/0 via G" / "::/0 via G" in route(6)-NAME.
func sysconfigRoutes(t *testing.T, out string) []route {
	dir := filepath.Join(out, "etc/sysconfig/network-scripts")
	var rs []route
	files, _ := filepath.Glob(filepath.Join(dir, "*-*"))
	for _, p := range files {
		kind, name, _ := strings.Cut(filepath.Base(p), "-")
		text := readRendered(t, p)
		for _, line := range strings.Split(text, "\n") {
			f := strings.Fields(line)
			switch {
			case kind == "ifcfg" && strings.HasPrefix(line, "GATEWAY="):
				rs = append(rs, route{name, "inet", strings.TrimPrefix(line, "GATEWAY=")})
			case kind == "ifcfg" && strings.HasPrefix(line, "IPV6_DEFAULTGW="):
				g, _, _ := strings.Cut(strings.TrimPrefix(line, "IPV6_DEFAULTGW="), "%")
				rs = append(rs, route{name, "inet6", g})
			case (kind == "route" || kind == "route6") && len(f) >= 3 && f[1] == "via" && (f[0] == "default" || f[0] == "0.0.0.0/0" || f[0] == "::/0"):
				rs = append(rs, route{name, familyOf(f[2]), f[2]})
			}
		}
	}
	return rs
}

func sysconfigDHCP4(t *testing.T, out, ifname string) bool {
	text := readRendered(t, filepath.Join(out, "etc/sysconfig/network-scripts/ifcfg-"+ifname))
	return strings.Contains(text, "\nBOOTPROTO=dhcp\n")
}

// nmRoutes: gateway= in the [ipv4] / [ipv6] section of
// cloud-init-NAME.nmconnection, or a routeN= to 0.0.0.0/0 or ::/0.
func nmRoutes(t *testing.T, out string) []route {
	files, _ := filepath.Glob(filepath.Join(out, "etc/NetworkManager/system-connections/cloud-init-*.nmconnection"))
	var rs []route
	for _, p := range files {
		name := strings.TrimSuffix(strings.TrimPrefix(filepath.Base(p), "cloud-init-"), ".nmconnection")
		for _, s := range iniSections(readRendered(t, p)) {
			if s.name != "ipv4" && s.name != "ipv6" {
				continue
			}
			family := map[string]string{"ipv4": "inet", "ipv6": "inet6"}[s.name]
			for k, v := range s.kv {
				dest, via, _ := strings.Cut(v, ",")
				switch {
				case k == "gateway":
					rs = append(rs, route{name, family, v})
				case strings.HasPrefix(k, "route") && (dest == "0.0.0.0/0" || dest == "::/0"):
					via, _, _ = strings.Cut(via, ",")
					rs = append(rs, route{name, family, via})
				}
			}
		}
	}
	return rs
}

func nmDHCP4(t *testing.T, out, ifname string) bool {
	for _, s := range iniSections(readRendered(t, filepath.Join(out, "etc/NetworkManager/system-connections/cloud-init-"+ifname+".nmconnection"))) {
		if s.name == "ipv4" && s.kv["method"] == "auto" {
			return true
		}
	}
	return false
}
