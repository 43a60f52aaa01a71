package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"
	"unicode/utf8"

	"vmhost/api"
	"vmhost/cli"
)

// openAPIRoutes returns every operation of the OpenAPI document the agent
// serves (vmhost openapi), as "METHOD /path".
func openAPIRoutes(t *testing.T) []string {
	t.Helper()
	b, err := api.OpenAPI()
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Paths map[string]map[string]json.RawMessage `json:"paths"`
	}
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	var routes []string
	for path, ops := range doc.Paths {
		for method := range ops {
			switch method {
			case "get", "put", "post", "patch", "delete":
				routes = append(routes, strings.ToUpper(method)+" "+path)
			}
		}
	}
	sort.Strings(routes)
	if len(routes) < 40 {
		t.Fatalf("the OpenAPI document has only %d operations", len(routes))
	}
	return routes
}

// TestEveryRouteHasACommand: each route of the API (its OpenAPI document)
// is called by a client command (cli.Synopses, whose routes cli's
// TestRoutes proves the commands really call).
func TestEveryRouteHasACommand(t *testing.T) {
	// Served by another command than the client's.
	elsewhere := map[string]string{"GET /api/openapi.json": "vmhost openapi prints the same document without an agent"}
	var covered []string
	for _, s := range cli.Synopses {
		covered = append(covered, s.Routes...)
	}
	for _, r := range openAPIRoutes(t) {
		if !slices.Contains(covered, r) && elsewhere[r] == "" {
			t.Errorf("no client command calls %s: add one to cli.Synopses", r)
		}
	}
}

// TestBareVmhost: vmhost alone prints where to start, not serve's
// "--listen is required"; vmhost --dev is still serve.
func TestBareVmhost(t *testing.T) {
	out, errOut, code := vmhost(t, "")
	if code != 2 || out != "" || !strings.Contains(errOut, "vmhost serve --dev") || !strings.Contains(errOut, "vmhost help") || strings.Contains(errOut, "--listen is required") {
		t.Errorf("vmhost = %d, %q, %q", code, out, errOut)
	}
	_, errOut, code = vmhost(t, t.TempDir(), "--listen", "127.0.0.1:0")
	if code != 2 || !strings.Contains(errOut, "--state-dir is required") {
		t.Errorf("vmhost --listen … = %d, %q; want serve's flags", code, errOut)
	}
	out, _, code = vmhost(t, "", "help")
	for _, s := range allSynopses() {
		if !strings.Contains(out, s.Line) {
			t.Errorf("vmhost help does not show %q", s.Line)
		}
	}
	if code != 0 {
		t.Errorf("vmhost help = %d", code)
	}
}

// TestManPage: vmhost man is a manual page groff reads without a warning
// (the check lintian makes), holding every command line of vmhost help.
func TestManPage(t *testing.T) {
	out, errOut, code := vmhost(t, "", "man")
	if code != 0 || !strings.HasPrefix(out, ".TH VMHOST 1 ") {
		t.Fatalf("vmhost man = %d, %q", code, errOut)
	}
	for _, s := range allSynopses() {
		if !strings.Contains(out, ".B "+roff(s.Line)+"\n") {
			t.Errorf("the manual page does not show %q", s.Line)
		}
	}
	for _, f := range cli.GlobalFlags {
		if !strings.Contains(out, roff(f.Line)) {
			t.Errorf("the manual page does not show the flag %q", f.Line)
		}
	}
	manTool := distTool(t, "man", "man-db")
	page := filepath.Join(t.TempDir(), "vmhost.1")
	os.WriteFile(page, []byte(out), 0o644)
	cmd := exec.Command(manTool, "--warnings", "-E", "UTF-8", "-l", "-Tutf8", "-Z", page)
	cmd.Env = append(os.Environ(), "LC_ALL=C.UTF-8", "MANWIDTH=80")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil || stderr.Len() > 0 {
		t.Errorf("man --warnings: %v\n%s", err, stderr.String())
	}
	if _, _, code := vmhost(t, "", "man", "x"); code != 2 {
		t.Errorf("vmhost man x = %d, want 2", code)
	}
}

// TestCompletionCommand: vmhost completion prints a script for each
// shell, knowing the agent's commands as well as the client's.
func TestCompletionCommand(t *testing.T) {
	for _, shell := range cli.Shells {
		out, errOut, code := vmhost(t, "", "completion", shell)
		if code != 0 || !strings.Contains(out, "doctor") || !strings.Contains(out, "registry") {
			t.Errorf("vmhost completion %s = %d, %q", shell, code, errOut)
		}
	}
	bash := distTool(t, "bash", "bash")
	out, _, _ := vmhost(t, "", "completion", "bash")
	script := filepath.Join(t.TempDir(), "vmhost.bash")
	os.WriteFile(script, []byte(out), 0o644)
	got, err := exec.Command(bash, "-c", `source "$1"; COMP_WORDS=(vmhost co); COMP_CWORD=1; _vmhost; echo "${COMPREPLY[*]}"; COMP_WORDS=(vmhost doctor --); COMP_CWORD=2; _vmhost; echo "${COMPREPLY[*]}"`, "bash", script).Output()
	if err != nil || string(got) != "config completion console\n--config --state-dir --api --token --token-file --cacert --cert --key\n" {
		t.Errorf("bash completion: %v\n%s", err, got)
	}
	for _, args := range [][]string{{"completion"}, {"completion", "tcsh"}, {"completion", "bash", "zsh"}} {
		if _, _, code := vmhost(t, "", args...); code != 2 {
			t.Errorf("vmhost %q = %d, want 2", args, code)
		}
	}
}

// TestConfigCheckLineColumn: vmhost config check names the file, line and
// column of each problem.
func TestConfigCheckLineColumn(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "config.json")
	os.WriteFile(bad, []byte("{\n  \"boot_timeout_secs\": 0,\n  \"networks\": [{\"id\": \"lan\", \"bridge\": \"br0\", \"vlan\": 3}]\n}\n"), 0o644)
	_, errOut, code := vmhost(t, dir, "config", "check", bad)
	if code != 1 || !strings.Contains(errOut, bad+`:3:47: networks[0]: unknown field "vlan"`) {
		t.Errorf("config check = %d, %q", code, errOut)
	}
	os.WriteFile(bad, []byte("{\n  \"boot_timeout_secs\": 0\n}\n"), 0o644)
	_, errOut, code = vmhost(t, dir, "config", "check", bad)
	if code != 1 || !strings.Contains(errOut, bad+":2:24: boot_timeout_secs: 0 must be at least 1") {
		t.Errorf("config check = %d, %q", code, errOut)
	}
}

// TestDoctorCommand runs vmhost doctor on this host with a configuration
// naming a bridge that does not exist: it fails (exit 1) on that line, with
// the fix; -o json carries the same checks; a bad configuration is named
// by line and column.
func TestDoctorCommand(t *testing.T) {
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.json")
	os.WriteFile(cfg, []byte(`{"networks": [{"id": "lan", "bridge": "br-doctor-none"}], "default_network": "lan"}`), 0o644)
	out, errOut, code := vmhost(t, dir, "doctor", "--config", cfg, "--state-dir", filepath.Join(dir, "state"))
	if code != 1 {
		t.Errorf("doctor = %d, want 1\n%s%s", code, out, errOut)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) < 12 || !strings.Contains(lines[0], cfg) {
		t.Fatalf("doctor printed:\n%s", out)
	}
	var found bool
	for _, l := range lines {
		if strings.HasPrefix(l, "FAIL  network lan") && strings.Contains(l, "bridge br-doctor-none does not exist") && strings.Contains(l, "fix: ip link add br-doctor-none type bridge") {
			found = true
		}
	}
	if !found {
		t.Errorf("no failing line for the missing bridge:\n%s", out)
	}
	out, _, code = vmhost(t, dir, "doctor", "--config", cfg, "--state-dir", filepath.Join(dir, "state"), "-o", "json")
	var doc struct {
		Config string `json:"config"`
		OK     bool   `json:"ok"`
		Checks []struct {
			Name, Status, Detail, Fix string
		} `json:"checks"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil || code != 1 || doc.OK || doc.Config != cfg || len(doc.Checks) != len(lines)-2 {
		t.Errorf("doctor -o json = %d, %v\n%s", code, err, out)
	}
	os.WriteFile(cfg, []byte(`{"networks": [{"id": "lan", "bridge": "br0", "mtu": 9}], "default_network": "lan"}`), 0o644)
	_, errOut, code = vmhost(t, dir, "doctor", "--config", cfg)
	if code != 1 || !strings.Contains(errOut, cfg+":1:53: networks[0].mtu") {
		t.Errorf("doctor with a bad config = %d, %q", code, errOut)
	}
	for _, args := range [][]string{{"doctor", "extra"}, {"doctor", "--bogus"}, {"doctor", "-o", "yaml"}} {
		if _, _, code := vmhost(t, dir, args...); code != 2 {
			t.Errorf("vmhost %q = %d, want 2", args, code)
		}
	}
}

// routeMention is a route as the API reference writes it: `METHOD /path`.
var routeMention = regexp.MustCompile("`(GET|POST|PUT|PATCH|DELETE) (/[^` ?]*)`")

// TestAPIReferenceCoversEveryRoute: every route of the OpenAPI document
// the agent serves has its place in docs/api.md, and every route the
// reference names is one the agent serves.
func TestAPIReferenceCoversEveryRoute(t *testing.T) {
	b, err := os.ReadFile("docs/api.md")
	if err != nil {
		t.Fatal(err)
	}
	routes := openAPIRoutes(t)
	mentioned := map[string]bool{}
	for _, m := range routeMention.FindAllStringSubmatch(string(b), -1) {
		mentioned[m[1]+" "+m[2]] = true
	}
	for _, r := range routes {
		if !mentioned[r] {
			t.Errorf("docs/api.md does not document %s", r)
		}
	}
	for r := range mentioned {
		if !slices.Contains(routes, r) {
			t.Errorf("docs/api.md names %s, which the agent does not serve", r)
		}
	}
}

// outsideReference matches what points outside the repository: the shared
// specification and design documents a checkout does not have, and the
// section citations of the contract those documents hold.
var outsideReference = regexp.MustCompile(`\.\./shared|shared/(spec|ref|DESIGN|STYLE)|DESIGN(\.md| §)|STYLE\.md|extensions(\.md| §)|(^|[^/])api\.md §`)

// readsSharedRef are tests (and their helper) that read reference
// documents beside the checkout when present, and skip without them.
var readsSharedRef = map[string]bool{
	"chclient/openapi_test.go":            true,
	"chclient/openapitest/openapitest.go": true,
}

// outsideReferencesPending are files of packages other work was changing
// while the documentation moved into docs/: their references are to be
// pointed at docs/ (and the entry removed) as they are merged.
var outsideReferencesPending = map[string]bool{
	"api/api.go": true, "api/appvmspec.go": true, "api/catalogs.go": true, "api/events.go": true,
	"api/images.go": true, "api/lifecycle.go": true, "api/metrics.go": true, "api/openapi.go": true,
	"api/volumes.go": true, "api/volumes_test.go": true,
	"appvm/redeploy.go": true, "appvm/specedit.go": true, "appvm/view.go": true, "appvm/volumes.go": true, "appvm/workload.go": true,
	"e2e/crash_test.go": true, "main_deps_test.go": true, "seed/render.go": true,
	"vm/engine/doc.go": true, "vm/engine/engine_boot.go": true, "vm/engine/monitor.go": true, "vm/engine/recover.go": true,
	"vm/engine/volumes.go": true, "vm/events.go": true, "vm/host.go": true, "vm/lifecycle.go": true,
	"vm/record/record.go": true, "vm/record/runtime.go": true, "vm/record/spec.go": true,
	"vm/validate.go": true, "vm/validate_test.go": true, "vm/volumes.go": true,
}

// TestNoReferenceOutsideTheRepository: no document, comment or shipped
// file of the repository points at documents outside it; docs/ holds the
// project's own. A file still pending must still need it (so the list
// only shrinks).
func TestNoReferenceOutsideTheRepository(t *testing.T) {
	out, err := exec.Command("git", "ls-files").Output()
	if err != nil {
		t.Skipf("git ls-files: %v (a checkout without git)", err)
	}
	for _, f := range strings.Fields(string(out)) {
		if strings.Contains(f, "testdata/") && !strings.HasSuffix(f, ".md") || strings.HasSuffix(f, ".sum") {
			continue
		}
		b, err := os.ReadFile(f)
		if err != nil || !utf8.Valid(b) {
			continue
		}
		var hits []string
		for i, line := range strings.Split(string(b), "\n") {
			if outsideReference.MatchString(line) {
				hits = append(hits, fmt.Sprintf("%s:%d: %s", f, i+1, strings.TrimSpace(line)))
			}
		}
		switch {
		case readsSharedRef[f]:
		case outsideReferencesPending[f] && len(hits) == 0:
			t.Errorf("%s no longer points outside the repository: remove it from outsideReferencesPending", f)
		case outsideReferencesPending[f]:
			t.Logf("pending: %s", strings.Join(hits, "\n"))
		default:
			for _, h := range hits {
				t.Errorf("%s: points outside the repository (use docs/)", h)
			}
		}
	}
}
