package seed

import (
	"fmt"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Config is what the seed is rendered from: the API's cloud_init object,
// every default applied by the caller, and, per interface, its MAC and
// static addresses.
type Config struct {
	// InstanceID is the NoCloud instance-id; required.
	InstanceID string
	// Hostname is the guest hostname (a DNS label of at most 63 bytes);
	// required.
	Hostname string
	// User is the account cloud-init configures (root, or a Linux login
	// name); required.
	User              string
	SSHAuthorizedKeys []string
	// Password is set as the user's password when not empty. It is never
	// part of an error or log message.
	Password string
	// ConsoleAutologin makes the ttyS0 serial console log User in without
	// a password.
	ConsoleAutologin bool
	// Sudo grants passwordless sudo to a non-root User; ignored for root.
	Sudo bool
	// Interfaces in guest order; index 0 is eth0 and takes
	// cloud_init.network, the others nets[i].ipv4/ipv6.
	Interfaces []Interface
}

// Interface is one guest NIC.
type Interface struct {
	// Name is the guest interface name set by network-config; empty means
	// "eth<index>".
	Name string
	// MAC is the guest MAC address (any form net.ParseMAC accepts for
	// 48-bit addresses); it is written lower-case with colons.
	MAC string
	// IPv4 is the static IPv4 configuration; nil means DHCP.
	IPv4 *Address
	// IPv6 is the static IPv6 configuration; nil means none is written.
	IPv6 *Address
}

// Address is a static address of one family.
type Address struct {
	// Address is the interface address with its prefix length, such as
	// 192.0.2.10/24 or 2001:db8::10/64.
	Address string
	// Gateway is the default-route next hop without a suffix; empty means
	// no default route through this interface.
	Gateway string
	// DNS lists name servers; those of both families are merged per
	// interface.
	DNS []string
}

// Files are the rendered NoCloud documents.
type Files struct {
	MetaData []byte
	UserData []byte
	// NetworkConfig is nil when every interface uses DHCP: the file is then
	// left off the seed and cloud-init's fallback (DHCP) applies.
	NetworkConfig []byte
}

// The seed's file names, exactly as NoCloud expects them.
const (
	MetaDataName      = "meta-data"
	UserDataName      = "user-data"
	NetworkConfigName = "network-config"
)

// ConfigError reports a Config field that cannot be rendered. Its message
// never includes the password.
type ConfigError struct {
	// Field is named like the API's cloud_init fields ("hostname",
	// "ssh_authorized_keys[0]"); "interfaces[i]" is Config.Interfaces[i],
	// that is nets[i] (or cloud_init.network for the first one's addresses).
	Field  string
	Reason string
}

func (e *ConfigError) Error() string {
	return "seed config " + e.Field + ": " + e.Reason
}

var (
	hostnameRE = regexp.MustCompile(`^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$`)
	// userRE is Debian's default NAME_REGEX with '_' allowed first, capped
	// at 32 bytes (utmp's limit).
	userRE   = regexp.MustCompile(`^[a-z_][a-z0-9_-]{0,31}$`)
	ifnameRE = regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,14}$`)
)

// PlainTextProblem reports why s cannot be rendered as a one-line value
// (invalid UTF-8, a control character of C0 or C1, U+2028 or U+2029, which
// YAML reads as line breaks), or "" when it can. Validation of the API's
// cloud_init values applies it, so a create the seed cannot render is 400.
func PlainTextProblem(s string) string {
	if !utf8.ValidString(s) {
		return "not valid UTF-8"
	}
	for _, r := range s {
		if unicode.IsControl(r) || r == 0x2028 || r == 0x2029 {
			return fmt.Sprintf("control character %U not allowed", r)
		}
	}
	return ""
}

// Validate reports the first field of c that cannot be rendered, as a
// *ConfigError. Render calls it.
func (c *Config) Validate() error {
	if c.InstanceID == "" {
		return &ConfigError{"instance_id", "required"}
	}
	if r := PlainTextProblem(c.InstanceID); r != "" {
		return &ConfigError{"instance_id", r}
	}
	switch {
	case c.Hostname == "":
		return &ConfigError{"hostname", "required"}
	case !hostnameRE.MatchString(c.Hostname):
		return &ConfigError{"hostname", "at most 63 letters, digits and '-', not starting or ending with '-'"}
	case c.User == "":
		return &ConfigError{"user", "required"}
	case !userRE.MatchString(c.User):
		return &ConfigError{"user", "must match " + userRE.String()}
	}
	for i, k := range c.SSHAuthorizedKeys {
		if r := PlainTextProblem(k); r != "" {
			return &ConfigError{fmt.Sprintf("ssh_authorized_keys[%d]", i), r}
		}
		if strings.TrimSpace(k) == "" {
			return &ConfigError{fmt.Sprintf("ssh_authorized_keys[%d]", i), "empty"}
		}
	}
	if PlainTextProblem(c.Password) != "" {
		// Say nothing about which character: the error must not leak
		// anything of the password.
		return &ConfigError{"password", "must be valid UTF-8 without control characters"}
	}
	gw4, gw6 := -1, -1
	names := make(map[string]int)
	for i, ifc := range c.Interfaces {
		field := fmt.Sprintf("interfaces[%d]", i)
		name := ifc.Name
		if name == "" {
			name = fmt.Sprintf("eth%d", i)
		}
		if !ifnameRE.MatchString(name) {
			return &ConfigError{field + ".name", "must match " + ifnameRE.String()}
		}
		if j, dup := names[name]; dup {
			return &ConfigError{field + ".name", fmt.Sprintf("%q also used by interfaces[%d]", name, j)}
		}
		names[name] = i
		if _, err := parseMAC(ifc.MAC); err != nil {
			return &ConfigError{field + ".mac", err.Error()}
		}
		for _, fam := range []struct {
			key string
			a   *Address
			v6  bool
			gw  *int
		}{{"ipv4", ifc.IPv4, false, &gw4}, {"ipv6", ifc.IPv6, true, &gw6}} {
			if fam.a == nil {
				continue
			}
			f := field + "." + fam.key
			p, err := netip.ParsePrefix(fam.a.Address)
			if err != nil || p.Addr().Zone() != "" {
				return &ConfigError{f + ".address", fmt.Sprintf("%q is not an address with a prefix length", fam.a.Address)}
			}
			if p.Addr().Is6() != fam.v6 || p.Addr().Is4In6() {
				return &ConfigError{f + ".address", fmt.Sprintf("%q is not an %s address", fam.a.Address, fam.key)}
			}
			if fam.a.Gateway != "" {
				g, err := netip.ParseAddr(fam.a.Gateway)
				if err != nil || g.Is6() != fam.v6 || g.Is4In6() || g.Zone() != "" {
					return &ConfigError{f + ".gateway", fmt.Sprintf("%q is not an %s address", fam.a.Gateway, fam.key)}
				}
				if *fam.gw >= 0 {
					return &ConfigError{f + ".gateway", fmt.Sprintf("interfaces[%d] already has the %s gateway", *fam.gw, fam.key)}
				}
				*fam.gw = i
			}
			for j, d := range fam.a.DNS {
				if a, err := netip.ParseAddr(d); err != nil || a.Zone() != "" {
					return &ConfigError{fmt.Sprintf("%s.dns[%d]", f, j), fmt.Sprintf("%q is not an IP address", d)}
				}
			}
		}
	}
	return nil
}

func parseMAC(s string) (string, error) {
	hw, err := net.ParseMAC(s)
	if err != nil {
		return "", fmt.Errorf("%q is not a MAC address", s)
	}
	if len(hw) != 6 {
		return "", fmt.Errorf("%q is not a 48-bit MAC address", s)
	}
	return hw.String(), nil // lower case, colons
}

// Render validates c and returns its meta-data, user-data and (unless every
// interface uses DHCP) network-config.
func Render(c Config) (Files, error) {
	if err := c.Validate(); err != nil {
		return Files{}, err
	}
	var f Files
	f.MetaData = renderMetaData(&c)
	f.UserData = renderUserData(&c)
	f.NetworkConfig = renderNetworkConfig(&c)
	return f, nil
}

func renderMetaData(c *Config) []byte {
	var b strings.Builder
	fmt.Fprintf(&b, "instance-id: %s\n", quote(c.InstanceID))
	fmt.Fprintf(&b, "local-hostname: %s\n", quote(c.Hostname))
	return []byte(b.String())
}

// Serial-console auto-login (docs/ref/nocloud-seed.md §2): the empty
// ExecStart= clears the packaged command; no -o option, or agetty drops -f.
const (
	autologinPath = "/etc/systemd/system/serial-getty@ttyS0.service.d/autologin.conf"
	autologinExec = "ExecStart=-/sbin/agetty --autologin %s --noclear --keep-baud 115200,57600,38400,9600 %%I $TERM"
)

func renderUserData(c *Config) []byte {
	var b strings.Builder
	user := c.User
	root := user == "root"
	b.WriteString("#cloud-config\n")
	fmt.Fprintf(&b, "hostname: %s\n", quote(c.Hostname))
	b.WriteString("manage_etc_hosts: true\n")
	if root {
		b.WriteString("disable_root: false\n")
	}
	b.WriteString("users:\n")
	fmt.Fprintf(&b, "  - name: %s\n", quote(user))
	if !root {
		b.WriteString("    shell: /bin/bash\n")
		if c.Sudo {
			b.WriteString("    sudo: \"ALL=(ALL) NOPASSWD:ALL\"\n")
		}
	}
	if c.Password != "" {
		b.WriteString("    lock_passwd: false\n")
		fmt.Fprintf(&b, "    plain_text_passwd: %s\n", quote(c.Password))
	}
	if len(c.SSHAuthorizedKeys) > 0 {
		b.WriteString("    ssh_authorized_keys:\n")
		for _, k := range c.SSHAuthorizedKeys {
			fmt.Fprintf(&b, "      - %s\n", quote(strings.TrimSpace(k)))
		}
	}
	if c.Password != "" {
		b.WriteString("chpasswd:\n  expire: false\n")
	}
	if c.ConsoleAutologin {
		b.WriteString("write_files:\n")
		fmt.Fprintf(&b, "  - path: %s\n", autologinPath)
		b.WriteString("    owner: root:root\n")
		b.WriteString("    permissions: '0644'\n")
		b.WriteString("    content: |\n")
		b.WriteString("      [Service]\n")
		b.WriteString("      ExecStart=\n")
		fmt.Fprintf(&b, "      "+autologinExec+"\n", user) // user matches userRE: no YAML or unit syntax
		b.WriteString("runcmd:\n")
		b.WriteString("  - [systemctl, daemon-reload]\n")
		b.WriteString("  - [systemctl, --no-block, restart, serial-getty@ttyS0.service]\n")
	}
	return []byte(b.String())
}

func renderNetworkConfig(c *Config) []byte {
	static := slices.ContainsFunc(c.Interfaces, func(i Interface) bool { return i.IPv4 != nil || i.IPv6 != nil })
	if !static {
		return nil
	}
	var b strings.Builder
	b.WriteString("version: 2\nethernets:\n")
	for i, ifc := range c.Interfaces {
		name := ifc.Name
		if name == "" {
			name = fmt.Sprintf("eth%d", i)
		}
		mac, _ := parseMAC(ifc.MAC) // checked by Validate
		fmt.Fprintf(&b, "  %s:\n", quote(name))
		b.WriteString("    match:\n")
		fmt.Fprintf(&b, "      macaddress: %s\n", quote(mac))
		fmt.Fprintf(&b, "    set-name: %s\n", quote(name))
		fmt.Fprintf(&b, "    dhcp4: %t\n", ifc.IPv4 == nil)
		if ifc.IPv4 != nil || ifc.IPv6 != nil {
			b.WriteString("    dhcp6: false\n")
		}
		var addrs, dns []string
		for _, a := range []*Address{ifc.IPv4, ifc.IPv6} {
			if a == nil {
				continue
			}
			addrs = append(addrs, netip.MustParsePrefix(a.Address).String())
			for _, d := range a.DNS {
				if d = netip.MustParseAddr(d).String(); !slices.Contains(dns, d) {
					dns = append(dns, d)
				}
			}
		}
		if len(addrs) > 0 {
			b.WriteString("    addresses:\n")
			for _, a := range addrs {
				fmt.Fprintf(&b, "      - %s\n", quote(a))
			}
		}
		// The subnet-gateway form, not a route to 0.0.0.0/0 or ::/0: it is
		// the one every renderer turns into a default route (package doc).
		if ifc.IPv4 != nil && ifc.IPv4.Gateway != "" {
			fmt.Fprintf(&b, "    gateway4: %s\n", quote(netip.MustParseAddr(ifc.IPv4.Gateway).String()))
		}
		if ifc.IPv6 != nil && ifc.IPv6.Gateway != "" {
			fmt.Fprintf(&b, "    gateway6: %s\n", quote(netip.MustParseAddr(ifc.IPv6.Gateway).String()))
		}
		if len(dns) > 0 {
			b.WriteString("    nameservers:\n      addresses:\n")
			for _, d := range dns {
				fmt.Fprintf(&b, "        - %s\n", quote(d))
			}
		}
	}
	return []byte(b.String())
}
