package seed

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strconv"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite testdata/render goldens")

const (
	keyAlice = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIB1Ux00yyMFquyDgv62uipuCdO14/uSjFvwHnRIAx2G3 alice@example"
	keyOps   = "ecdsa-sha2-nistp256 AAAAE2VjZHNhLXNoYTItbmlzdHAyNTYAAAAIbmlzdHAyNTYAAABBBEmKSENjQEezOmxkZMy7opKgwFB9nkt5YRrYMjNuG5N87uRgg6CLrbo5wAdT/y6v0mKV0U2w0WZ2YB/++Tpockg= ops@example"
)

// renderCases cover every rendering rule; their output is in
// testdata/render/<name>/ (a missing network-config file means none).
var renderCases = []struct {
	name string
	cfg  Config
}{
	{"root-dhcp", Config{
		InstanceID:        "iid-web-01",
		Hostname:          "web-01",
		User:              "root",
		SSHAuthorizedKeys: []string{keyAlice},
		Interfaces:        []Interface{{MAC: "02:00:00:AA:BB:01"}},
	}},
	{"root-password-autologin", Config{
		InstanceID:        "iid-0f3a9c2e-5b7d-4e21-9a6c-1d2e3f405162",
		Hostname:          "0f3a9c2e-5b7d-4e21-9a6c-1d2e3f405162",
		User:              "root",
		SSHAuthorizedKeys: []string{keyAlice},
		Password:          "correct horse battery staple",
		ConsoleAutologin:  true,
		Interfaces:        []Interface{{MAC: "02:00:00:aa:bb:02"}},
	}},
	{"user-sudo-password-static", Config{
		InstanceID:        "iid-db_primary.1",
		Hostname:          "db1",
		User:              "alice",
		Sudo:              true,
		Password:          "changeme",
		SSHAuthorizedKeys: []string{keyAlice, keyOps},
		Interfaces: []Interface{{MAC: "02-00-00-aa-bb-03", IPv4: &Address{
			Address: "192.0.2.10/24", Gateway: "192.0.2.1", DNS: []string{"192.0.2.53", "9.9.9.9"},
		}}},
	}},
	{"user-no-sudo-keys-only", Config{
		InstanceID:        "migrated-from-host-a-0007",
		Hostname:          "build-7",
		User:              "bob",
		SSHAuthorizedKeys: []string{keyOps},
		Interfaces:        []Interface{{MAC: "02:00:00:aa:bb:04"}, {MAC: "02:00:00:aa:bb:05"}},
	}},
	{"user-autologin-no-password", Config{
		InstanceID:       "iid-console-box",
		Hostname:         "console-box",
		User:             "carol",
		ConsoleAutologin: true,
	}},
	{"static-dual-stack-multi-nic", Config{
		InstanceID:        "iid-router-1",
		Hostname:          "router-1",
		User:              "root",
		SSHAuthorizedKeys: []string{keyAlice},
		Interfaces: []Interface{
			{MAC: "02:00:00:aa:bb:06",
				IPv4: &Address{Address: "192.0.2.10/24", Gateway: "192.0.2.1", DNS: []string{"192.0.2.53"}},
				IPv6: &Address{Address: "2001:DB8:10::10/64", Gateway: "2001:db8:10::1", DNS: []string{"2001:db8:10::53", "192.0.2.53"}}},
			{MAC: "02:00:00:aa:bb:07", IPv4: &Address{Address: "198.51.100.5/25", DNS: []string{"198.51.100.53"}}},
			{MAC: "02:00:00:aa:bb:08"},
			{Name: "backend", MAC: "02:00:00:aa:bb:09", IPv6: &Address{Address: "fd00:1::9/64"}},
		},
	}},
	{"hostile-strings", Config{
		Hostname:   "evil",
		InstanceID: `iid: "x" # not a comment ' & *alias !tag {a: b} [c] % @ ` + "`" + ` ünïcödé ✓ 😀 \ end`,
		User:       "eve",
		SSHAuthorizedKeys: []string{
			`ssh-ed25519 AAAA" injected: true`,
			`command="echo hi; rm -rf /",no-pty ssh-ed25519 AAAA key: with colon # and hash`,
			"- ssh-rsa AAAA\\n not a newline \u00a0nbsp \u200b zero-width 日本語",
		},
		Password:         `p"a:s's\w#o{r}d [1] & *x | > ! % ünï 😀`,
		ConsoleAutologin: true,
		Interfaces:       []Interface{{Name: "on", MAC: "02:00:00:aa:bb:0a", IPv4: &Address{Address: "10.0.0.2/8"}}},
	}},
}

func goldenDir(name string) string { return filepath.Join("testdata", "render", name) }

func TestRenderGoldens(t *testing.T) {
	for _, tc := range renderCases {
		t.Run(tc.name, func(t *testing.T) {
			f, err := Render(tc.cfg)
			if err != nil {
				t.Fatalf("Render: %v", err)
			}
			dir := goldenDir(tc.name)
			docs := map[string][]byte{MetaDataName: f.MetaData, UserDataName: f.UserData, NetworkConfigName: f.NetworkConfig}
			if *update {
				if err := os.MkdirAll(dir, 0o755); err != nil {
					t.Fatal(err)
				}
				for name, data := range docs {
					p := filepath.Join(dir, name)
					if data == nil {
						os.Remove(p)
						continue
					}
					if err := os.WriteFile(p, data, 0o644); err != nil {
						t.Fatal(err)
					}
				}
			}
			for name, got := range docs {
				want, err := os.ReadFile(filepath.Join(dir, name))
				if errors.Is(err, os.ErrNotExist) {
					if got != nil {
						t.Errorf("%s rendered but has no golden:\n%s", name, got)
					}
					continue
				}
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(got, want) {
					t.Errorf("%s differs from its golden (go test -update):\n--- got\n%s\n--- want\n%s", name, got, want)
				}
			}
			if !bytes.HasPrefix(f.UserData, []byte("#cloud-config\n")) {
				t.Errorf("user-data does not start with #cloud-config")
			}
			again, _ := Render(tc.cfg)
			if !reflect.DeepEqual(f, again) {
				t.Error("rendering twice gave different documents")
			}
		})
	}
}

func TestRenderRules(t *testing.T) {
	render := func(c Config) Files {
		t.Helper()
		f, err := Render(c)
		if err != nil {
			t.Fatalf("Render: %v", err)
		}
		return f
	}
	base := Config{InstanceID: "iid-vm1", Hostname: "vm1", User: "root", Interfaces: []Interface{{MAC: "02:00:00:00:00:01"}}}

	if f := render(base); f.NetworkConfig != nil {
		t.Errorf("all-DHCP VM got network-config:\n%s", f.NetworkConfig)
	}
	if f := render(Config{InstanceID: "iid-vm1", Hostname: "vm1", User: "root"}); f.NetworkConfig != nil {
		t.Errorf("VM without interfaces got network-config")
	}
	ud := string(render(base).UserData)
	for _, absent := range []string{"sudo", "passwd", "chpasswd", "write_files", "runcmd", "ssh_authorized_keys", "shell:"} {
		if strings.Contains(ud, absent) {
			t.Errorf("root user-data without options contains %q:\n%s", absent, ud)
		}
	}
	if !strings.Contains(ud, "disable_root: false\n") || !strings.Contains(ud, `  - name: "root"`) {
		t.Errorf("default user is not root:\n%s", ud)
	}

	// sudo is ignored for root and granted to others only when asked.
	withSudo := base
	withSudo.Sudo = true
	if ud := string(render(withSudo).UserData); strings.Contains(ud, "sudo") {
		t.Errorf("root got a sudo key:\n%s", ud)
	}
	withSudo.User = "alice"
	if ud := string(render(withSudo).UserData); !strings.Contains(ud, `    sudo: "ALL=(ALL) NOPASSWD:ALL"`+"\n") || strings.Contains(ud, "disable_root") {
		t.Errorf("alice with sudo:\n%s", ud)
	}
	withSudo.Sudo = false
	if ud := string(render(withSudo).UserData); strings.Contains(ud, "sudo") {
		t.Errorf("alice without sudo got a sudo key:\n%s", ud)
	}

	// A password comes with an unlocked account and no expiry.
	withPw := base
	withPw.Password = "pw"
	ud = string(render(withPw).UserData)
	for _, want := range []string{"    lock_passwd: false\n", "    plain_text_passwd: \"pw\"\n", "chpasswd:\n  expire: false\n"} {
		if !strings.Contains(ud, want) {
			t.Errorf("user-data with password lacks %q:\n%s", want, ud)
		}
	}

	// meta-data holds the instance-id and hostname as given: their
	// defaults are the caller's (vm/record's CloudInitSpec.Identity).
	md := string(render(Config{InstanceID: "My_VM.01", Hostname: "My-VM-01", User: "root"}).MetaData)
	if md != "instance-id: \"My_VM.01\"\nlocal-hostname: \"My-VM-01\"\n" {
		t.Errorf("meta-data = %q", md)
	}
}

func TestValidate(t *testing.T) {
	const secret = "hunter2\nroot:owned"
	ok := Config{InstanceID: "iid-vm1", Hostname: "vm1", User: "root", Interfaces: []Interface{{MAC: "02:00:00:00:00:01"}}}
	tests := []struct {
		field string
		edit  func(c *Config)
	}{
		{"instance_id", func(c *Config) { c.InstanceID = "" }},
		{"hostname", func(c *Config) { c.Hostname = "" }},
		{"user", func(c *Config) { c.User = "" }},
		{"instance_id", func(c *Config) { c.InstanceID = "a\nb" }},
		{"hostname", func(c *Config) { c.Hostname = `a"b` }},
		{"hostname", func(c *Config) { c.Hostname = "a:b" }},
		{"hostname", func(c *Config) { c.Hostname = "-a" }},
		{"hostname", func(c *Config) { c.Hostname = "ä" }},
		{"hostname", func(c *Config) { c.Hostname = strings.Repeat("a", 64) }},
		{"user", func(c *Config) { c.User = "alice --login root" }},
		{"user", func(c *Config) { c.User = "Alice" }},
		{"ssh_authorized_keys[1]", func(c *Config) { c.SSHAuthorizedKeys = []string{"k", "ssh-ed25519 A\nssh-ed25519 B"} }},
		{"ssh_authorized_keys[0]", func(c *Config) { c.SSHAuthorizedKeys = []string{" "} }},
		{"ssh_authorized_keys[0]", func(c *Config) { c.SSHAuthorizedKeys = []string{"a\xffb"} }},
		{"password", func(c *Config) { c.Password = secret }},
		{"password", func(c *Config) { c.Password = "hunter2\u2028" }},
		{"interfaces[0].mac", func(c *Config) { c.Interfaces[0].MAC = "" }},
		{"interfaces[0].mac", func(c *Config) { c.Interfaces[0].MAC = "02:00:00:00:00:00:00:01" }},
		{"interfaces[0].name", func(c *Config) { c.Interfaces[0].Name = "eth0: x" }},
		{"interfaces[1].name", func(c *Config) {
			c.Interfaces = append(c.Interfaces, Interface{Name: "eth0", MAC: "02:00:00:00:00:02"})
		}},
		{"interfaces[0].ipv4.address", func(c *Config) { c.Interfaces[0].IPv4 = &Address{Address: "192.0.2.1"} }},
		{"interfaces[0].ipv4.address", func(c *Config) { c.Interfaces[0].IPv4 = &Address{Address: "2001:db8::1/64"} }},
		{"interfaces[0].ipv6.address", func(c *Config) { c.Interfaces[0].IPv6 = &Address{Address: "192.0.2.1/24"} }},
		{"interfaces[0].ipv4.gateway", func(c *Config) {
			c.Interfaces[0].IPv4 = &Address{Address: "192.0.2.2/24", Gateway: "2001:db8::1"}
		}},
		{"interfaces[0].ipv4.dns[0]", func(c *Config) {
			c.Interfaces[0].IPv4 = &Address{Address: "192.0.2.2/24", DNS: []string{"dns.example"}}
		}},
		{"interfaces[1].ipv6.gateway", func(c *Config) {
			c.Interfaces[0].IPv6 = &Address{Address: "2001:db8::2/64", Gateway: "2001:db8::1"}
			c.Interfaces = append(c.Interfaces, Interface{MAC: "02:00:00:00:00:02", IPv6: &Address{Address: "2001:db8:1::2/64", Gateway: "2001:db8:1::1"}})
		}},
	}
	for _, tt := range tests {
		c := ok
		c.Interfaces = append([]Interface(nil), ok.Interfaces...)
		tt.edit(&c)
		_, err := Render(c)
		var ce *ConfigError
		if !errors.As(err, &ce) || ce.Field != tt.field {
			t.Errorf("Render with bad %s: error %v, want a *ConfigError for %s", tt.field, err, tt.field)
			continue
		}
		if strings.Contains(err.Error(), "hunter2") {
			t.Errorf("error %q leaks the password", err)
		}
	}
	for _, tc := range renderCases {
		if err := tc.cfg.Validate(); err != nil {
			t.Errorf("%s: Validate: %v", tc.name, err)
		}
	}
}

// unquoteYAML decodes one YAML double-quoted scalar that must span the whole
// of s, as a parser would.
func unquoteYAML(s string) (string, error) {
	if len(s) < 2 || s[0] != '"' || s[len(s)-1] != '"' {
		return "", fmt.Errorf("not a double-quoted scalar: %q", s)
	}
	in := s[1 : len(s)-1]
	var b strings.Builder
	for i := 0; i < len(in); i++ {
		c := in[i]
		switch {
		case c == '"':
			return "", fmt.Errorf("unescaped quote inside %q", s)
		case c < 0x20 || c == 0x7F:
			return "", fmt.Errorf("raw control byte 0x%02X inside %q", c, s)
		case c != '\\':
			b.WriteByte(c)
			continue
		}
		i++
		if i == len(in) {
			return "", fmt.Errorf("dangling backslash in %q", s)
		}
		hex := map[byte]int{'x': 2, 'u': 4, 'U': 8}
		switch e := in[i]; e {
		case '"', '\\', '/':
			b.WriteByte(e)
		case 'n':
			b.WriteByte('\n')
		case 't':
			b.WriteByte('\t')
		case 'r':
			b.WriteByte('\r')
		case '0':
			b.WriteByte(0)
		case 'x', 'u', 'U':
			n := hex[e]
			if i+1+n > len(in) {
				return "", fmt.Errorf("short escape in %q", s)
			}
			v, err := strconv.ParseUint(in[i+1:i+1+n], 16, 32)
			if err != nil {
				return "", err
			}
			b.WriteRune(rune(v))
			i += n
		default:
			return "", fmt.Errorf("escape \\%c not used by the renderer in %q", e, s)
		}
	}
	return b.String(), nil
}

func TestQuote(t *testing.T) {
	for _, s := range []string{
		"", "plain", `"`, `\`, `a"b\c`, "new\nline", "tab\tcr\r", "nul\x00", "bell\x07del\x7f",
		"nel\u0085ls\u2028ps\u2029", "bom\ufeff", "\ufffe\uffff", "ünïcödé 😀 日本語", "c1\u0080\u009f",
		"key: value # comment", "- item", "&anchor *alias !tag", "'single'", "{a: b}", "[1, 2]",
	} {
		q := quote(s)
		if strings.ContainsAny(q, "\n\r\u0085\u2028\u2029\ufeff") {
			t.Errorf("quote(%q) = %q contains a raw line break or BOM", s, q)
		}
		got, err := unquoteYAML(q)
		if err != nil || got != s {
			t.Errorf("unquote(quote(%q)) = %q, %v", s, got, err)
		}
	}
	if got := quote("a\xffb"); got != `"a\uFFFDb"` {
		t.Errorf("quote of invalid UTF-8 = %s", got)
	}
}

// TestHostileStringsStayInTheirFields checks, without a YAML library, that
// each hostile value is exactly one line holding one quoted scalar equal to
// the input, and that the documents have the same shape as with tame values.
func TestHostileStringsStayInTheirFields(t *testing.T) {
	var hostile Config
	for _, tc := range renderCases {
		if tc.name == "hostile-strings" {
			hostile = tc.cfg
		}
	}
	tame := hostile
	tame.InstanceID = "iid-tame"
	tame.Password = "tame"
	tame.SSHAuthorizedKeys = []string{"k1", "k2", "k3"}
	tame.Interfaces = []Interface{{Name: "eth0", MAC: "02:00:00:aa:bb:0a", IPv4: &Address{Address: "10.0.0.2/8"}}}
	hf, err := Render(hostile)
	if err != nil {
		t.Fatal(err)
	}
	tf, err := Render(tame)
	if err != nil {
		t.Fatal(err)
	}
	shape := func(doc []byte) []string {
		var keys []string
		for _, line := range strings.Split(string(doc), "\n") {
			k, _, _ := strings.Cut(line, `"`) // the part before any quoted value
			keys = append(keys, k)
		}
		return keys
	}
	for _, d := range [][2][]byte{{hf.MetaData, tf.MetaData}, {hf.UserData, tf.UserData}, {hf.NetworkConfig, tf.NetworkConfig}} {
		if got, want := shape(d[0]), shape(d[1]); !reflect.DeepEqual(got, want) {
			t.Errorf("hostile document shape\n%q\ndiffers from tame\n%q", got, want)
		}
	}
	value := func(doc []byte, prefix string, n int) string {
		t.Helper()
		for _, line := range strings.Split(string(doc), "\n") {
			if rest, ok := strings.CutPrefix(line, prefix); ok {
				if n--; n < 0 {
					v, err := unquoteYAML(rest)
					if err != nil {
						t.Errorf("line %q: %v", line, err)
					}
					return v
				}
			}
		}
		t.Errorf("no line %d starting %q", n, prefix)
		return ""
	}
	if got := value(hf.MetaData, "instance-id: ", 0); got != hostile.InstanceID {
		t.Errorf("instance-id = %q, want %q", got, hostile.InstanceID)
	}
	if got := value(hf.UserData, "    plain_text_passwd: ", 0); got != hostile.Password {
		t.Error("plain_text_passwd does not read back as the password")
	}
	for i, k := range hostile.SSHAuthorizedKeys {
		if got := value(hf.UserData, "      - ", i); got != k {
			t.Errorf("key %d = %q, want %q", i, got, k)
		}
	}
	if got := value(hf.NetworkConfig, "    set-name: ", 0); got != "on" {
		t.Errorf("set-name = %q, want on", got)
	}
}

// pythonYAML returns a function that parses YAML with PyYAML (what
// cloud-init uses) into JSON-decoded values, or skips t.
func pythonYAML(t *testing.T) func(doc []byte) any {
	t.Helper()
	py, err := exec.LookPath("python3")
	if err != nil {
		t.Skip("python3 not installed; the quoting is still checked by TestHostileStringsStayInTheirFields")
	}
	if out, err := exec.Command(py, "-c", "import yaml").CombinedOutput(); err != nil {
		t.Skipf("python3 has no yaml module (apt-get install python3-yaml): %v %s", err, out)
	}
	return func(doc []byte) any {
		t.Helper()
		cmd := exec.Command(py, "-c", "import sys, json, yaml; json.dump(yaml.safe_load(sys.stdin.buffer), sys.stdout)")
		cmd.Stdin = bytes.NewReader(doc)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("PyYAML rejected the document: %v\n%s", err, doc)
		}
		var v any
		if err := json.Unmarshal(out, &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
}

// TestRenderedYAMLWithPyYAML parses every golden case with the YAML library
// cloud-init itself uses and checks the values that came from Config.
func TestRenderedYAMLWithPyYAML(t *testing.T) {
	parse := pythonYAML(t)
	for _, tc := range renderCases {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.cfg
			f, err := Render(c)
			if err != nil {
				t.Fatal(err)
			}
			md := parse(f.MetaData).(map[string]any)
			if md["instance-id"] != c.InstanceID || md["local-hostname"] != c.Hostname {
				t.Errorf("meta-data = %v", md)
			}
			ud := parse(f.UserData).(map[string]any)
			if ud["hostname"] != c.Hostname {
				t.Errorf("hostname = %v", ud["hostname"])
			}
			users := ud["users"].([]any)
			u := users[0].(map[string]any)
			if len(users) != 1 || u["name"] != c.User {
				t.Errorf("users = %v", users)
			}
			var keys []any
			for _, k := range c.SSHAuthorizedKeys {
				keys = append(keys, k)
			}
			if !reflect.DeepEqual(u["ssh_authorized_keys"], keys) && len(keys) > 0 {
				t.Errorf("ssh_authorized_keys = %q, want %q", u["ssh_authorized_keys"], keys)
			}
			if c.Password != "" && (u["plain_text_passwd"] != c.Password || u["lock_passwd"] != false) {
				t.Error("password or lock_passwd wrong")
			}
			if c.Password != "" && !reflect.DeepEqual(ud["chpasswd"], map[string]any{"expire": false}) {
				t.Errorf("chpasswd = %v", ud["chpasswd"])
			}
			if _, has := u["sudo"]; has != (c.Sudo && c.User != "root") {
				t.Errorf("sudo = %v with Sudo %v", u["sudo"], c.Sudo)
			}
			if c.ConsoleAutologin {
				wf := ud["write_files"].([]any)[0].(map[string]any)
				want := "[Service]\nExecStart=\nExecStart=-/sbin/agetty --autologin " + c.User + " --noclear --keep-baud 115200,57600,38400,9600 %I $TERM\n"
				if wf["path"] != autologinPath || wf["content"] != want {
					t.Errorf("write_files = %v", wf)
				}
				rc := fmt.Sprint(ud["runcmd"])
				if rc != "[[systemctl daemon-reload] [systemctl --no-block restart serial-getty@ttyS0.service]]" {
					t.Errorf("runcmd = %s", rc)
				}
			}
			if f.NetworkConfig == nil {
				return
			}
			nc := parse(f.NetworkConfig).(map[string]any)
			if nc["version"] != float64(2) {
				t.Errorf("version = %v", nc["version"])
			}
			eths := nc["ethernets"].(map[string]any)
			if len(eths) != len(c.Interfaces) {
				t.Errorf("%d ethernets, want %d", len(eths), len(c.Interfaces))
			}
			for i, ifc := range c.Interfaces {
				name := ifc.Name
				if name == "" {
					name = fmt.Sprintf("eth%d", i)
				}
				e, ok := eths[name].(map[string]any)
				if !ok {
					t.Errorf("no ethernets[%q] in %v", name, eths)
					continue
				}
				mac, _ := parseMAC(ifc.MAC)
				if e["match"].(map[string]any)["macaddress"] != mac || e["set-name"] != name || e["dhcp4"] != (ifc.IPv4 == nil) {
					t.Errorf("%s = %v", name, e)
				}
			}
		})
	}
}
