package main

import (
	"bytes"
	"errors"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// vmhostEnv runs the binary like vmhost, with extra environment variables.
func vmhostEnv(t *testing.T, dir string, env []string, args ...string) (stdout, stderr string, code int) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), env...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	var ee *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &ee):
		code = ee.ExitCode()
	default:
		t.Fatalf("running vmhost %q: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// rows splits a table into its lines' fields.
func rows(out string) [][]string {
	var r [][]string
	for _, l := range strings.Split(strings.TrimRight(out, "\n"), "\n") {
		r = append(r, strings.Fields(l))
	}
	return r
}

// TestCLIAgainstAgent drives the client commands of the binary against a
// real agent (serve --dev, simulators) on a unix socket: tables, -o json
// as the API's body, lifecycle actions, API errors as CODE: message with
// exit 1, usage errors with exit 2, and the token never printed.
func TestCLIAgainstAgent(t *testing.T) {
	cwd, err := os.MkdirTemp("", "vh") // short: the run dir holds sockets
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(cwd) })
	sock := filepath.Join(cwd, "api.sock")
	s := startServer(t, cwd, "--dev", "--listen", "unix:"+sock)
	token := devToken(t, s)
	t.Cleanup(func() { s.deleteVM(t, token, "n1") }) // if the test stops before its delete
	env := []string{"VMHOST_API=unix:" + sock, "VMHOST_TOKEN=" + token}
	var all strings.Builder // every output, to look for the token in
	run := func(args ...string) (string, string, int) {
		t.Helper()
		out, errOut, code := vmhostEnv(t, cwd, env, args...)
		all.WriteString(out + errOut)
		return out, errOut, code
	}

	body := filepath.Join(cwd, "vm.json")
	os.WriteFile(body, []byte(vmBody(t, cwd, "n1", false)), 0o600)
	out, errOut, code := run("vm", "create", "-f", body)
	header := []string{"ID", "MODE", "STATE", "DISPLAY", "STATE", "VCPUS", "MEMORY", "IPV4", "AGE"}
	if r := rows(out); code != 0 || len(r) != 2 || strings.Join(r[0], " ") != strings.Join(header, " ") ||
		strings.Join(r[1][:7], " ") != "n1 vm created created 1 128MiB -" {
		t.Fatalf("vm create = %d\n%s%s", code, out, errOut)
	}
	out, _, code = run("vm", "list")
	if r := rows(out); code != 0 || len(r) != 2 || r[1][0] != "n1" || r[1][2] != "created" {
		t.Errorf("vm list = %d\n%s", code, out)
	}
	// -o json is the API's body, byte for byte.
	out, _, code = run("vm", "list", "-o", "json")
	c, base := s.client()
	req, _ := http.NewRequest("GET", base+"/api/vms", nil)
	req.Header.Set("Authorization", "Bearer "+token)
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	want, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if code != 0 || out != string(want) {
		t.Errorf("vm list -o json = %d\n%s\nwant the API's body\n%s", code, out, want)
	}

	// Client flags before the command (not taken as serve's), and vmhost
	// list showing both families.
	if out2, errOut, code := run("-o", "json", "vm", "list"); code != 0 || out2 != out {
		t.Errorf("vmhost -o json vm list = %d, %q, %q; want what vm list -o json printed", code, out2, errOut)
	}
	if out, errOut, code := run("--api", "unix:"+sock, "list"); code != 0 || len(rows(out)) != 2 || rows(out)[1][0] != "n1" {
		t.Errorf("vmhost --api … list = %d\n%s%s", code, out, errOut)
	}
	if out, errOut, code := run("network", "list"); code != 0 || rows(out)[1][0] != "default" || rows(out)[1][1] != "vmhost0" {
		t.Errorf("vmhost network list = %d\n%s%s", code, out, errOut)
	}
	if out, errOut, code = run("vm", "start", "n1"); code != 0 || out != "n1: start accepted\n" {
		t.Errorf("vm start = %d, %q, %q", code, out, errOut)
	}
	if out, _, code = run("vm", "get", "n1"); code != 0 || rows(out)[1][2] != "running" {
		t.Errorf("vm get after start = %d\n%s", code, out)
	}
	// Flags after the id work too.
	if out, _, code = run("vm", "get", "n1", "-o", "json"); code != 0 || !strings.Contains(out, `"id":"n1"`) {
		t.Errorf("vm get n1 -o json = %d\n%s", code, out)
	}
	out, errOut, code = run("vm", "delete", "n1")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "INVALID_STATE: ") {
		t.Errorf("vm delete of a running VM = %d, %q, %q; want 1 and INVALID_STATE: …", code, out, errOut)
	}
	// A stop the operator asked for is the last stop, not a failure.
	if out, errOut, code = run("vm", "stop", "n1"); code != 0 {
		t.Errorf("vm stop = %d, %q", code, errOut)
	}
	if out, _, code = run("vm", "get", "n1"); code != 0 || !strings.HasSuffix(out, "\nlast stop: stopped by the operator\n") {
		t.Errorf("vm get after a stop = %d\n%s", code, out)
	}
	if out, errOut, code = run("vm", "delete", "--force", "n1"); code != 0 || out != "n1: deleted\n" {
		t.Errorf("vm delete --force = %d, %q, %q", code, out, errOut)
	}
	out, errOut, code = run("vm", "get", "n1")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "NOT_FOUND: ") {
		t.Errorf("vm get of a deleted VM = %d, %q, %q", code, out, errOut)
	}
	if out, _, code = run("appvm", "list"); code != 0 || len(rows(out)) != 1 || rows(out)[0][0] != "ID" {
		t.Errorf("appvm list = %d\n%s", code, out)
	}
	if out, _, code = run("image", "list"); code != 0 || strings.Join(rows(out)[0], " ") != "ID STATUS REIMPORT AGE SOURCE" {
		t.Errorf("image list = %d\n%s", code, out)
	}
	if _, errOut, code = run("image", "delete", "nope"); code != 1 || !strings.HasPrefix(errOut, "NOT_FOUND: ") {
		t.Errorf("image delete nope = %d, %q", code, errOut)
	}
	// The API form of image import: the agent reads the path.
	if _, errOut, code = run("image", "import", "--id", "app", filepath.Join(cwd, "missing.tar")); code != 1 || !strings.HasPrefix(errOut, "BAD_REQUEST: path: ") {
		t.Errorf("image import of a missing file through the API = %d, %q", code, errOut)
	}

	for _, args := range [][]string{
		{"vm"}, {"vm", "frob"}, {"vm", "get"}, {"vm", "get", "a", "b"}, {"vm", "list", "-o", "yaml"},
		{"vm", "create"}, {"vm", "list", "--bogus"}, {"volume", "attach", "n1"}, {"events", "x"}, {"console"},
		{"image", "frob"},
	} {
		if out, errOut, code := run(args...); code != 2 || out != "" || errOut == "" {
			t.Errorf("vmhost %q = %d, %q, %q; want 2, a message and no stdout", args, code, out, errOut)
		}
	}

	for _, args := range [][]string{{"vm", "-h"}, {"appvm", "help"}, {"volume", "--help"}, {"image", "list", "-h"}, {"events", "-h"}} {
		if _, _, code := run(args...); code != 0 {
			t.Errorf("vmhost %q = %d, want 0", args, code)
		}
	}

	// Without a key: the API's 401, and a hint.
	out, errOut, code = vmhostEnv(t, cwd, []string{"VMHOST_API=unix:" + sock, "VMHOST_TOKEN="}, "vm", "list")
	if code != 1 || out != "" || !strings.HasPrefix(errOut, "UNAUTHORIZED: ") || !strings.Contains(errOut, "VMHOST_TOKEN") {
		t.Errorf("vm list without a key = %d, %q, %q", code, out, errOut)
	}
	// --api and --token override the environment; a wrong key is 401 and
	// is not echoed.
	out, errOut, code = vmhostEnv(t, cwd, []string{"VMHOST_API=http://127.0.0.1:1"}, "vm", "list", "--api", "unix:"+sock, "--token", "vmh_wrong-key-value")
	if code != 1 || !strings.HasPrefix(errOut, "UNAUTHORIZED: ") || strings.Contains(out+errOut, "wrong-key-value") {
		t.Errorf("vm list with a wrong key = %d, %q, %q", code, out, errOut)
	}
	if strings.Contains(all.String(), strings.TrimPrefix(token, "vmh_")) {
		t.Error("a client command printed the API key")
	}
	// An agent that is not there.
	_, errOut, code = vmhostEnv(t, cwd, []string{"VMHOST_API=unix:" + filepath.Join(cwd, "absent.sock")}, "vm", "list")
	if code != 1 || !strings.Contains(errOut, "absent.sock") {
		t.Errorf("vm list with no agent = %d, %q", code, errOut)
	}
}
