package main

import (
	"debug/elf"
	"os/exec"
	"strings"
	"testing"
)

// allowedModules are the module prefixes the vmhost binary may link besides
// the standard library (DESIGN §1). go-cmp is in go.mod but must never be
// linked.
var allowedModules = []string{
	"vmhost",
	"golang.org/x/sys",
	"golang.org/x/net",
	"golang.org/x/sync",
	"github.com/mdlayher/netlink",
	"github.com/mdlayher/socket",
	"github.com/mdlayher/vsock",
	"github.com/google/uuid",
}

func allowedDep(pkg string) bool {
	for _, m := range allowedModules {
		if pkg == m || strings.HasPrefix(pkg, m+"/") {
			return true
		}
	}
	return false
}

func TestDeps(t *testing.T) {
	cmd := exec.Command(goTool(t), "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", ".")
	cmd.Env = append(cmd.Environ(), "CGO_ENABLED=0")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list -deps: %v\n%s", err, exitStderr(err))
	}
	var seen int
	for _, pkg := range strings.Fields(string(out)) {
		seen++
		if !allowedDep(pkg) {
			t.Errorf("vmhost links %s, which is outside the allowed modules %q", pkg, allowedModules)
		}
	}
	if seen == 0 {
		t.Fatal("go list -deps listed no packages at all; the check is broken")
	}
}

// TestLayering keeps imports pointing down (api → appvm → vm → engine →
// leaves → internal/): no package imports one above it.
func TestLayering(t *testing.T) {
	above := map[string][]string{ // package → packages it must not import
		"./vm/record": {"vmhost/vm", "vmhost/vm/engine", "vmhost/appvm", "vmhost/api"},
		"./vm/engine": {"vmhost/vm", "vmhost/appvm", "vmhost/api"},
		"./vm":        {"vmhost/appvm", "vmhost/api"},
		"./appvm":     {"vmhost/api"},
		// The server runs the service main wires; it builds none of it.
		"./server": {"vmhost/vm", "vmhost/vm/engine", "vmhost/appvm", "vmhost/api"},
	}
	for pkg, banned := range above {
		cmd := exec.Command(goTool(t), "list", "-deps", "-f", "{{.ImportPath}}", pkg)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, exitStderr(err))
		}
		deps := strings.Fields(string(out))
		if len(deps) == 0 {
			t.Fatalf("go list -deps %s listed nothing; the check is broken", pkg)
		}
		for _, d := range deps {
			for _, b := range banned {
				if d == b {
					t.Errorf("%s imports %s, which is above it", pkg, d)
				}
			}
		}
	}
}

// TestClientLeaves: the API client (cli) talks HTTP only, and sdnotify is a
// leaf: neither imports any package of ours, so the client cannot reach
// around the API into api, vm or appvm.
func TestClientLeaves(t *testing.T) {
	for _, pkg := range []string{"./cli", "./sdnotify"} {
		cmd := exec.Command(goTool(t), "list", "-deps", "-f", "{{.ImportPath}}", pkg)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v\n%s", pkg, err, exitStderr(err))
		}
		deps := strings.Fields(string(out))
		if len(deps) == 0 {
			t.Fatalf("go list -deps %s listed nothing; the check is broken", pkg)
		}
		for _, d := range deps {
			if strings.HasPrefix(d, "vmhost/") && d != "vmhost/"+strings.TrimPrefix(pkg, "./") {
				t.Errorf("%s imports %s: it must talk to the agent over HTTP (or be a leaf) only", pkg, d)
			}
		}
	}
}

func TestAllowedDep(t *testing.T) {
	for pkg, want := range map[string]bool{
		"vmhost":                            true,
		"vmhost/store":                      true,
		"golang.org/x/sys/unix":             true,
		"github.com/mdlayher/netlink/nlenc": true,
		"github.com/google/go-cmp/cmp":      false,
		"golang.org/x/syscall":              false,
		"vmhostile/x":                       false,
		"github.com/mdlayher/wifi":          false,
	} {
		if got := allowedDep(pkg); got != want {
			t.Errorf("allowedDep(%q) = %v, want %v", pkg, got, want)
		}
	}
}

// TestStaticBinary checks the binary TestMain built with CGO_ENABLED=0: no
// program interpreter and no dynamic section, so it runs on any Linux host.
func TestStaticBinary(t *testing.T) {
	f, err := elf.Open(binary(t))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP || p.Type == elf.PT_DYNAMIC {
			t.Errorf("vmhost binary has a %v program header: not statically linked", p.Type)
		}
	}
	if libs, _ := f.ImportedLibraries(); len(libs) > 0 {
		t.Errorf("vmhost binary imports shared libraries %q", libs)
	}
}
