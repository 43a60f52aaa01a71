package realguest

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// opsWorkload is the workload of the operations AppVM: it writes a file
// for the host to copy out, reads back (hashes) one the host copies in,
// and notes each SIGHUP.
const opsWorkload = `trap 'echo got-hup >>/tmp/hup' HUP
head -c 2097152 /dev/urandom >/tmp/out.bin
sha256sum /tmp/out.bin >/tmp/out.sha
while :; do
	if [ -f /tmp/in.bin ] && [ ! -f /tmp/in.sha ]; then sha256sum /tmp/in.bin >/tmp/in.sha; fi
	sleep 0.2
done`

// cli runs the vmhost client against the lane's agent.
func (l *lane) cli(stdin string, args ...string) (string, string, int) {
	l.t.Helper()
	cmd := exec.Command(l.bin, args...)
	cmd.Env = append(os.Environ(), "VMHOST_API=unix:"+l.sock, "VMHOST_TOKEN="+l.token)
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	code := 0
	switch {
	case errors.As(err, &ee):
		code = ee.ExitCode()
	case err != nil:
		l.t.Fatalf("vmhost %q: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// appVMOps: exec, files and signals through the client in a real guest on
// Debian's cloud kernel: uname -r answers the cloud kernel's release; an
// interactive shell in tmux runs a command and exits with its status; a
// file copied in is read back by the workload, and one it wrote comes out
// byte for byte; a signal reaches the workload.
func appVMOps(l *lane, a artifacts) {
	t := l.t
	const id = "lane-ops"
	req := map[string]any{
		"vm_id": id, "image_id": "busybox", "vcpus": 1, "memory_mb": 256, "disk_gib": 1,
		"network_id": "lane", "secret_env": []string{"LANE_SECRET=" + laneSecret},
		"command": []string{"/bin/sh", "-c", opsWorkload},
	}
	start := time.Now()
	body, _ := json.Marshal(req)
	l.must("POST", "/api/appvm/vms", string(body), http.StatusCreated)
	l.waitView("/api/appvm/vms", id, "display running", appvmTimeout, func(v vmView) bool { return v.DisplayState == "running" })
	phase(t, "appvm ops: running", start)

	release := filepath.Base(a.modules)
	var out, errOut string
	var code int
	// The guest agent takes operations once the workload's root is ready,
	// which may follow its first heartbeat by a moment.
	l.poll("an exec of uname -r", time.Minute, func() bool {
		out, errOut, code = l.cli("", "appvm", "exec", id, "--", "uname", "-r")
		return code == 0
	})
	if strings.TrimSpace(out) != release {
		t.Errorf("uname -r in the AppVM = %q (%s), want the cloud kernel's %q", out, errOut, release)
	}
	if out, _, code := l.cli("", "appvm", "exec", id, "--", "sh", "-c", "echo $LANE_SECRET; exit 7"); code != 7 || out != "[redacted]\n" {
		t.Errorf("exec of the secret = %d %q, want 7 and [redacted]", code, out)
	}
	phase(t, "appvm ops: exec", start)

	interactiveShell(l, id)
	phase(t, "appvm ops: interactive shell in tmux", start)

	// A file in, read back by the workload.
	in := make([]byte, 1<<20+3)
	rand.Read(in)
	local := filepath.Join(l.dir, "in.bin")
	os.WriteFile(local, in, 0o644)
	if _, errOut, code := l.cli("", "appvm", "cp", local, id+":/tmp"); code != 0 {
		t.Fatalf("cp in = %d %s", code, errOut)
	}
	sum := sha256.Sum256(in)
	l.poll("the workload to read the file copied in", time.Minute, func() bool {
		out, _, code := l.cli("", "appvm", "exec", id, "--", "cat", "/tmp/in.sha")
		return code == 0 && strings.HasPrefix(out, hex.EncodeToString(sum[:])+" ")
	})
	// The file it wrote, out byte for byte.
	outDir := filepath.Join(l.dir, "out")
	os.Mkdir(outDir, 0o755)
	for _, f := range []string{"out.bin", "out.sha"} {
		if _, errOut, code := l.cli("", "appvm", "cp", id+":/tmp/"+f, outDir); code != 0 {
			t.Fatalf("cp out %s = %d %s", f, code, errOut)
		}
	}
	got, _ := os.ReadFile(filepath.Join(outDir, "out.bin"))
	want, _ := os.ReadFile(filepath.Join(outDir, "out.sha"))
	gotSum := sha256.Sum256(got)
	if len(got) != 2<<20 || !strings.HasPrefix(string(want), hex.EncodeToString(gotSum[:])+" ") {
		t.Errorf("the file copied out (%d bytes, sha256 %x) is not the one the workload wrote (%q)", len(got), gotSum, want)
	}
	phase(t, "appvm ops: files in and out", start)

	if _, errOut, code := l.cli("", "appvm", "kill", id, "--signal", "HUP"); code != 0 {
		t.Fatalf("kill = %d %s", code, errOut)
	}
	l.poll("the workload to get SIGHUP", time.Minute, func() bool {
		out, _, _ := l.cli("", "appvm", "exec", id, "--", "cat", "/tmp/hup")
		return strings.Contains(out, "got-hup")
	})
	phase(t, "appvm ops: signal", start)
	l.deleteVM("/api/appvm/vms", id)
}

// interactiveShell runs `vmhost appvm exec -it ID -- sh` in a tmux
// terminal, types a command and exit 4 at it (send-keys), and reads the
// pane and the client's exit status.
func interactiveShell(l *lane, id string) {
	t := l.t
	if _, err := exec.LookPath("tmux"); err != nil {
		need(t, false, "tmux is not installed (run e2e/realguest/prepare.sh)")
	}
	tokenFile := filepath.Join(l.dir, "token")
	os.WriteFile(tokenFile, []byte(l.token), 0o600)
	status := filepath.Join(l.dir, "tmux-status")
	sock := "vhl-ops-" + randomHex(4)
	tmux := func(args ...string) string {
		t.Helper()
		out, err := exec.Command("tmux", append([]string{"-L", sock}, args...)...).CombinedOutput()
		if err != nil {
			t.Fatalf("tmux %q: %v %s", args, err, out)
		}
		return string(out)
	}
	shell := l.bin + " --api unix:" + l.sock + " --token-file " + tokenFile + " appvm exec -it " + id + " -- sh; echo exit=$? >" + status + "; sleep 30"
	tmux("new-session", "-d", "-s", "ops", "-x", "120", "-y", "30", shell)
	defer exec.Command("tmux", "-L", sock, "kill-server").Run()
	var pane string
	l.poll("a shell prompt in the tmux pane", 2*time.Minute, func() bool {
		pane = tmux("capture-pane", "-p", "-t", "ops")
		return strings.Contains(pane, "#") || strings.Contains(pane, "$")
	})
	tmux("send-keys", "-t", "ops", "echo tmux-$((6*7)) $(stty size)", "Enter")
	l.poll("the command's output in the pane", time.Minute, func() bool {
		pane = tmux("capture-pane", "-p", "-t", "ops")
		return strings.Contains(pane, "tmux-42 30 120")
	})
	tmux("send-keys", "-t", "ops", "exit 4", "Enter")
	l.poll("the client's exit status", time.Minute, func() bool {
		b, _ := os.ReadFile(status)
		return strings.TrimSpace(string(b)) != ""
	})
	if b, _ := os.ReadFile(status); strings.TrimSpace(string(b)) != "exit=4" {
		t.Errorf("vmhost appvm exec -it: %s; the pane showed:\n%s", b, pane)
	}
}
