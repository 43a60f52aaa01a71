package appvm_test

import (
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"

	"vmhost/appvm/guest"
	"vmhost/chclient/chsim"
	"vmhost/qmp/qsdsim"
)

// netnsEnv marks a test binary already re-executed in a private network
// namespace.
const netnsEnv = "VMHOST_APPVM_TEST_NETNS"

// TestMain runs the test binary as one of the programs the integration
// tests start, chosen by the first argument (go test never passes these):
// "sim-ch" (the engine's CH, PreArgs ["sim-ch"]), "sim-qsd", and "guest"
// (the guest agent chsim starts as `<its executable> guest ...`). As root,
// the tests themselves run re-executed under `unshare --net`, so the
// bridge and taps of the integration tests live in a private network
// namespace that vanishes with the process.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 {
		switch os.Args[1] {
		case "sim-ch":
			os.Exit(chsim.Main(os.Args[2:]))
		case "sim-qsd":
			os.Exit(qsdsim.Main(os.Args[2:]))
		case "guest":
			os.Exit(guest.Main(os.Args[2:]))
		}
	}
	// The simulators and the guest agent are this binary: under -race
	// their exit would otherwise sleep a second, with CH's API socket
	// already gone (which the monitor rightly calls socket_gone).
	os.Setenv("GORACE", strings.TrimSpace(os.Getenv("GORACE")+" atexit_sleep_ms=0"))
	if os.Geteuid() == 0 && os.Getenv(netnsEnv) == "" {
		if p, err := exec.LookPath("unshare"); err == nil && exec.Command(p, "--net", "true").Run() == nil {
			env := append(os.Environ(), netnsEnv+"=1")
			err := syscall.Exec(p, append([]string{"unshare", "--net", "--"}, os.Args...), env)
			// Exec returns only on failure: run here, the privileged tests skip.
			os.Stderr.WriteString("re-executing in a network namespace: " + err.Error() + "\n")
		}
	}
	if os.Getenv(netnsEnv) == "1" {
		// The new namespace's loopback starts down; the API test server
		// listens on it.
		if out, err := exec.Command("ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
			os.Stderr.WriteString("bringing lo up: " + err.Error() + ": " + string(out) + "\n")
		}
	}
	os.Exit(m.Run())
}

// inPrivateNetns reports whether the tests run in their own network
// namespace (root, unshare available); the integration tests need it.
func inPrivateNetns(t *testing.T) {
	t.Helper()
	if os.Getenv(netnsEnv) != "1" {
		t.Skip("needs root and unshare(1): the AppVM integration tests create a bridge and taps in a private network namespace")
	}
}
