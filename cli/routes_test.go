package cli

import (
	"archive/tar"
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// routeRecorder is a fake API that knows exactly the routes the synopses
// declare (as an http.ServeMux does, patterns and all): it records the
// pattern each request matched, or "unmatched METHOD PATH".
type routeRecorder struct {
	mu     sync.Mutex
	seen   []string
	mux    *http.ServeMux
	cancel context.CancelFunc // ends a command that streams (events)
	// stopped is closed by the stop of vmhost run's sig1.
	stopped chan struct{}
}

func newRouteRecorder(routes []string) *routeRecorder {
	rr := &routeRecorder{mux: http.NewServeMux(), stopped: make(chan struct{})}
	for _, route := range routes {
		rr.mux.HandleFunc(route, func(w http.ResponseWriter, r *http.Request) {
			rr.mu.Lock()
			rr.seen = append(rr.seen, r.Pattern)
			rr.mu.Unlock()
			// vmhost run: attach1 and sig1 exist already (attached to);
			// sig1's run is interrupted while it waits, and its shutdown
			// falls back to a stop.
			existing := strings.Contains(r.URL.Path, "attach1") || strings.Contains(r.URL.Path, "sig1")
			switch {
			case r.Pattern == "GET /api/appvm/vms/{id}/files":
				w.Header().Set("Content-Type", "application/x-tar")
				w.Write(oneFileTar("hostname", "x1\n"))
			case r.Pattern == "POST /api/appvm/vms/{id}/exec":
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, `{"exit_code":0,"stdout":"","stderr":"","truncated":false,"duration_ms":1}`)
			case r.Pattern == "POST /api/appvm/vms":
				b, _ := io.ReadAll(r.Body)
				if strings.Contains(string(b), "attach1") || strings.Contains(string(b), "sig1") {
					w.WriteHeader(409)
					io.WriteString(w, `{"code":"ALREADY_EXISTS","message":"exists"}`)
					return
				}
				w.WriteHeader(201)
				io.WriteString(w, `{"id":"x1","mode":"appvm","image_id":"i1","booted":true}`)
			case r.Pattern == "GET /api/appvm/vms/{id}" && existing:
				io.WriteString(w, `{"id":"x1","mode":"appvm","state":"stopped","appvm":{"image_id":"i1"}}`)
			case strings.HasSuffix(r.Pattern, "/wait"):
				if strings.Contains(r.URL.Path, "sig1") {
					rr.cancel() // the first SIGINT
					select {
					case <-rr.stopped:
					case <-time.After(10 * time.Second):
					}
				}
				io.WriteString(w, `{"id":"x1","mode":"appvm","state":"stopped","appvm":{"image_id":"i1","workload_exit_code":0}}`)
			case r.Pattern == "POST /api/appvm/vms/{id}/shutdown" && existing:
				w.WriteHeader(409)
				io.WriteString(w, `{"code":"INVALID_STATE","message":"not running"}`)
			case r.Pattern == "POST /api/appvm/vms/{id}/stop" && existing:
				w.WriteHeader(204)
				close(rr.stopped)
			case strings.HasSuffix(r.Pattern, "/logs") && strings.Contains(r.URL.Path, "gone1") && r.URL.Query().Has("since_seq"):
				// A follow taken up again after its answer ended: the
				// AppVM is gone.
				w.WriteHeader(404)
				io.WriteString(w, `{"code":"NOT_FOUND","message":"no AppVM has this id"}`)
			case strings.HasSuffix(r.Pattern, "/logs"):
				w.Header().Set("Content-Type", "application/x-ndjson")
				io.WriteString(w, `{"seq":1,"time":"2026-01-02T03:04:05Z","stream":"stdout","data":"x\n"}`+"\n")
			case r.Pattern == "GET /api/events":
				w.Header().Set("Content-Type", "text/event-stream")
				w.WriteHeader(200)
				rr.cancel()
			case r.Method == "GET" || r.Method == "PATCH" || strings.HasSuffix(r.Pattern, "/volumes") ||
				strings.Contains(r.Pattern, "/volumes/{vol}") || strings.HasSuffix(r.Pattern, "/redeploy") || r.Pattern == "POST /api/volumes" || r.Pattern == "POST /api/appvm/images" ||
				strings.HasSuffix(r.Pattern, "/snapshots") || strings.HasSuffix(r.Pattern, "/restore"):
				w.Header().Set("Content-Type", "application/json")
				io.WriteString(w, `{"id":"x1"}`)
			case r.Pattern == "POST /api/vms" || r.Pattern == "POST /api/appvm/vms":
				w.WriteHeader(201)
				io.WriteString(w, `{"id":"x1","mode":"vm","state":"created"}`)
			default:
				w.WriteHeader(204)
			}
		})
	}
	rr.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		rr.mu.Lock()
		rr.seen = append(rr.seen, "unmatched "+r.Method+" "+r.URL.Path)
		rr.mu.Unlock()
		w.WriteHeader(404)
		io.WriteString(w, `{"code":"NOT_FOUND","message":"no such route"}`)
	})
	return rr
}

// oneFileTar is a tar archive of one file.
func oneFileTar(name, content string) []byte {
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	tw.WriteHeader(&tar.Header{Name: name, Mode: 0o644, Size: int64(len(content)), Typeflag: tar.TypeReg})
	io.WriteString(tw, content)
	tw.Close()
	return b.Bytes()
}

func (rr *routeRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) { rr.mux.ServeHTTP(w, r) }

// TestRoutes: each client command calls exactly the API routes its
// synopsis declares, and every declared route is called by some command:
// the routes the synopses list (which main's tests hold against the
// agent's OpenAPI document) are the ones the client really covers.
func TestRoutes(t *testing.T) {
	var declared []string
	for _, s := range Synopses {
		for _, r := range s.Routes {
			if !slices.Contains(declared, r) {
				declared = append(declared, r)
			}
		}
	}
	rr := newRouteRecorder(declared)
	body := filepath.Join(t.TempDir(), "body.json")
	os.WriteFile(body, []byte(`{}`), 0o600)
	image := filepath.Join(t.TempDir(), "image.tar")

	invocations := [][]string{
		{"list"},
		{"vm", "list"}, {"vm", "get", "x1"}, {"vm", "create", "-f", body},
		{"vm", "start", "x1"}, {"vm", "stop", "x1"}, {"vm", "shutdown", "x1"}, {"vm", "pause", "x1"}, {"vm", "resume", "x1"}, {"vm", "reboot", "x1"},
		{"vm", "balloon", "x1", "64"}, {"vm", "delete", "x1", "--force"},
		{"appvm", "list"}, {"appvm", "get", "x1"}, {"appvm", "create", "-f", body},
		{"appvm", "start", "x1"}, {"appvm", "stop", "x1"}, {"appvm", "shutdown", "x1"}, {"appvm", "pause", "x1"}, {"appvm", "resume", "x1"}, {"appvm", "reboot", "x1"},
		{"appvm", "edit", "x1", "-f", body, "--restart"}, {"appvm", "redeploy", "x1"}, {"appvm", "balloon", "x1", "0"}, {"appvm", "delete", "x1"},
		{"vm", "create", "-f", body, "--from-snapshot", "s1"}, {"vm", "start", "x1", "--cold"},
		{"vm", "suspend", "x1"}, {"vm", "snapshot", "x1", "--id", "s1", "--memory"}, {"vm", "restore", "x1", "s1"},
		{"appvm", "suspend", "x1"}, {"appvm", "snapshot", "x1"}, {"appvm", "restore", "x1", "s1"}, {"appvm", "start", "x1", "--cold"},
		{"snapshot", "list"}, {"snapshot", "list", "--vm", "x1"}, {"snapshot", "get", "s1"}, {"snapshot", "delete", "s1"},
		{"appvm", "exec", "x1", "--", "true"}, {"appvm", "cp", "x1:/etc/hostname", t.TempDir()}, {"appvm", "cp", body, "x1:/tmp"},
		{"appvm", "kill", "x1", "--signal", "HUP"},
		{"vm", "wait", "x1", "--for", "running"}, {"vm", "console-log", "x1"},
		{"appvm", "wait", "x1", "--for", "running,failed", "--timeout", "5s"}, {"appvm", "console-log", "x1", "-f"}, {"appvm", "logs", "x1", "--tail", "5"}, {"appvm", "logs", "gone1", "-f"},
		{"volume", "list"}, {"volume", "get", "v1"}, {"volume", "create", "--size-gib", "1"}, {"volume", "delete", "v1"},
		{"volume", "attach", "x1", "--size-gib", "1"}, {"volume", "attach", "x1", "--appvm", "--volume", "v1", "--mountpoint", "/data"},
		{"volume", "detach", "x1", "data0"}, {"volume", "detach", "x1", "v1", "--appvm"},
		{"image", "list"}, {"image", "get", "i1"}, {"image", "import", "--id", "i1", image}, {"image", "delete", "i1"},
		{"registry", "list"}, {"registry", "get", "r1"},
		{"cache", "list"}, {"cache", "delete", "abc"},
		{"network", "list"}, {"host", "pci"}, {"host"},
		{"events"}, {"metrics"}, {"health"},
		{"run", "--rm", "--image", "i1", "--", "echo", "hi"}, {"run", "--name", "attach1", "--image", "i1"},
		{"run", "--name", "sig1", "--image", "i1", "--disk-gib", "2"},
		{"vm", "label", "x1", "team=infra", "old-"}, {"appvm", "label", "x1", "team=infra"},
		{"list", "--label", "team=infra"}, {"vm", "list", "--label", "team"}, {"events", "--label", "team=infra"},
	}
	called := map[string]bool{}
	for _, args := range invocations {
		// The synopsis of a verb the arguments name, else the command's
		// without verbs (vmhost host, vmhost host pci).
		var synopsis *Synopsis
		for i := range Synopses {
			cmd, verbs := Synopses[i].Command()
			if cmd != args[0] {
				continue
			}
			if len(args) > 1 && slices.Contains(verbs, args[1]) {
				synopsis = &Synopses[i]
				break
			}
			if len(verbs) == 0 && synopsis == nil {
				synopsis = &Synopses[i]
			}
		}
		if synopsis == nil {
			t.Errorf("vmhost %q: no synopsis", args)
			continue
		}
		ctx, cancel := context.WithCancel(context.Background())
		rr.mu.Lock()
		rr.seen, rr.cancel = nil, cancel
		rr.mu.Unlock()
		// A server per command: its Close waits for every request the
		// command sent, also one whose client gave up (a follow cut off
		// at the end), so none is counted as the next command's.
		srv := httptest.NewServer(rr)
		var out, errb bytes.Buffer
		env := map[string]string{"VMHOST_API": srv.URL, "VMHOST_TOKEN": "vmh_test"}
		code := Run(ctx, args, strings.NewReader(""), &out, &errb, func(k string) string { return env[k] })
		cancel()
		srv.Close()
		if code != 0 {
			t.Errorf("vmhost %q = %d: %s", args, code, errb.String())
		}
		rr.mu.Lock()
		seen := slices.Clone(rr.seen)
		rr.mu.Unlock()
		if len(seen) == 0 {
			t.Errorf("vmhost %q called no route", args)
		}
		for _, route := range seen {
			if !slices.Contains(synopsis.Routes, route) {
				t.Errorf("vmhost %q called %s, which its synopsis %q does not declare", args, route, synopsis.Line)
			}
			called[route] = true
		}
	}
	for _, r := range declared {
		if !called[r] {
			t.Errorf("no command called %s, which a synopsis declares", r)
		}
	}
}

// TestGlobalFlagsBeforeTheCommand: client flags work before the command
// as after its arguments, and one given after wins over one before.
func TestGlobalFlagsBeforeTheCommand(t *testing.T) {
	rec := &recorder{answers: map[string]answer{"GET /api/vms/x": {200, `{"id":"x","mode":"vm","state":"running"}`}}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	for _, args := range [][]string{
		{"--api", srv.URL, "-o", "json", "vm", "get", "x"},
		{"-o=json", "vm", "get", "x", "--api", srv.URL},
		{"--api", "http://127.0.0.1:1", "-o", "table", "vm", "get", "x", "--api", srv.URL, "-o", "json"},
	} {
		var out, errb bytes.Buffer
		env := map[string]string{"VMHOST_TOKEN": "vmh_test"}
		code := Run(context.Background(), args, strings.NewReader(""), &out, &errb, func(k string) string { return env[k] })
		if code != 0 || out.String() != `{"id":"x","mode":"vm","state":"running"}`+"\n" {
			t.Errorf("vmhost %q = %d, %q, %q", args, code, out.String(), errb.String())
		}
	}
	for _, a := range []string{"--api", "-o", "--token-file=x", "-cacert"} {
		if !IsGlobalFlag(a) {
			t.Errorf("IsGlobalFlag(%q) = false", a)
		}
	}
	for _, a := range []string{"--dev", "--listen", "api", "-state-dir"} {
		if IsGlobalFlag(a) {
			t.Errorf("IsGlobalFlag(%q) = true", a)
		}
	}
}

// TestListBothFamilies: vmhost list shows the classic VMs and the AppVMs
// in one table by id; -o json keeps each view as the API gave it.
func TestListBothFamilies(t *testing.T) {
	rec := &recorder{answers: map[string]answer{
		"GET /api/vms":       {200, `{"vms":[{"id":"web","mode":"vm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048,"extra":1}]}`},
		"GET /api/appvm/vms": {200, `{"vms":[{"id":"app","mode":"appvm","state":"stopped","display_state":"stopped","vcpus":1,"memory_mb":256}]}`},
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	out, errOut, code := runCLI(t, srv.URL, "list")
	want := "" +
		"ID   MODE   STATE    DISPLAY STATE  VCPUS  MEMORY  IPV4  AGE\n" +
		"app  appvm  stopped  stopped        1      256MiB  -     -\n" +
		"web  vm     running  running        2      2GiB    -     -\n"
	if code != 0 || out != want {
		t.Errorf("list = %d\n%s%s\nwant\n%s", code, out, errOut, want)
	}
	out, _, code = runCLI(t, srv.URL, "list", "-o", "json")
	if code != 0 || out != `{"vms":[{"id":"app","mode":"appvm","state":"stopped","display_state":"stopped","vcpus":1,"memory_mb":256},{"id":"web","mode":"vm","state":"running","display_state":"running","vcpus":2,"memory_mb":2048,"extra":1}]}`+"\n" {
		t.Errorf("list -o json = %d\n%s", code, out)
	}
}

// TestCleanStopIsNotAFailure: a VM stopped by its operator or its guest
// shows its last stop; a crash shows as a failure.
func TestCleanStopIsNotAFailure(t *testing.T) {
	rec := &recorder{answers: map[string]answer{
		"GET /api/vms/a": {200, `{"id":"a","mode":"vm","state":"stopped","failure_reason":{"summary":"stopped by the operator","cause":"operator_shutdown"}}`},
		"GET /api/vms/b": {200, `{"id":"b","mode":"vm","state":"stopped","failure_reason":{"summary":"the guest powered off","cause":"guest_shutdown"}}`},
		"GET /api/vms/c": {200, `{"id":"c","mode":"vm","state":"failed","failure_reason":{"summary":"cloud-hypervisor was killed by signal 9","cause":"ch_crash"}}`},
	}}
	srv := httptest.NewServer(rec)
	defer srv.Close()
	for id, want := range map[string]string{"a": "last stop: stopped by the operator", "b": "last stop: the guest powered off", "c": "failure: cloud-hypervisor was killed by signal 9"} {
		out, _, code := runCLI(t, srv.URL, "vm", "get", id)
		if code != 0 || !strings.HasSuffix(out, want+"\n") || (id != "c" && strings.Contains(out, "failure")) {
			t.Errorf("vm get %s = %d\n%s\nwant it to end with %q", id, code, out, want)
		}
	}
}

// TestNoAgentHint: with no --api and no $VMHOST_API, a missing default
// socket says how to reach a dev agent; a named address that is absent
// only names it.
func TestNoAgentHint(t *testing.T) {
	client, err := newClient(&options{}, func(string) string { return "" })
	if err != nil || !client.defaulted || client.api != DefaultAPI {
		t.Fatalf("newClient without --api or $VMHOST_API = %+v, %v", client, err)
	}
	if c, _ := newClient(&options{}, func(k string) string { return map[string]string{"VMHOST_API": "http://h:1"}[k] }); c.defaulted {
		t.Error("$VMHOST_API counts as defaulted")
	}
	// The default socket may exist on a host running the agent: use an
	// absent one, marked as the default.
	absent := "unix:" + filepath.Join(t.TempDir(), "api.sock")
	client, err = newClient(&options{api: absent}, func(string) string { return "" })
	if err != nil {
		t.Fatal(err)
	}
	client.defaulted = true
	_, _, err = client.do(context.Background(), "GET", "/api/vms", nil)
	if err == nil || !strings.Contains(err.Error(), "export VMHOST_API=") || !strings.Contains(err.Error(), "vmhost serve --dev") {
		t.Errorf("error without an agent: %v", err)
	}
	client.defaulted = false
	_, _, err = client.do(context.Background(), "GET", "/api/vms", nil)
	if err == nil || strings.Contains(err.Error(), "serve --dev") || !strings.Contains(err.Error(), "api.sock") {
		t.Errorf("error with a named API that is absent: %v", err)
	}
}

// TestCompletion: the bash script completes commands, verbs and flags as
// bash itself runs it; zsh and fish accept their scripts, and fish
// completes from its own.
func TestCompletion(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	script, err := Completion("bash", Synopses, GlobalFlags)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "vmhost.bash")
	os.WriteFile(path, []byte(script), 0o644)
	for _, tt := range []struct {
		words []string
		want  string
	}{
		{[]string{"vmhost", ""}, strings.Join(Commands, " ")},
		{[]string{"vmhost", "vo"}, "volume"},
		{[]string{"vmhost", "vm", ""}, "list get create start stop shutdown pause resume reboot balloon label delete wait console-log suspend snapshot restore"},
		{[]string{"vmhost", "--api", "unix:/x", "appvm", "re"}, "resume reboot redeploy restore"},
		{[]string{"vmhost", "snapshot", ""}, "list get delete"},
		{[]string{"vmhost", "vm", "start", "web", "--c"}, "--cold --cacert --cert"},
		{[]string{"vmhost", "vm", "delete", "--f"}, "--force"},
		{[]string{"vmhost", "volume", "attach", "web", "--m"}, "--mountpoint"},
		{[]string{"vmhost", "-o", "json", "host", ""}, "pci"},
		{[]string{"vmhost", "events", "--t"}, "--token --token-file"},
	} {
		cmd := exec.Command(bash, "-c", `source "$1"; shift; COMP_WORDS=("$@"); COMP_CWORD=$(($#-1)); _vmhost; echo "${COMPREPLY[*]}"`, "bash", path)
		cmd.Args = append(cmd.Args, tt.words...)
		out, err := cmd.CombinedOutput()
		if got := strings.TrimSpace(string(out)); err != nil || got != tt.want {
			t.Errorf("bash completion of %q = %q, %v; want %q", tt.words, got, err, tt.want)
		}
	}

	for _, shell := range []string{"zsh", "fish"} {
		t.Run(shell, func(t *testing.T) {
			bin, err := exec.LookPath(shell)
			if err != nil {
				if os.Getenv("CI") != "" {
					t.Fatalf("%s not installed (apt-get install %s), and CI is set", shell, shell)
				}
				t.Skipf("%s not installed (apt-get install %s)", shell, shell)
			}
			script, err := Completion(shell, Synopses, GlobalFlags)
			if err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(t.TempDir(), "vmhost."+shell)
			os.WriteFile(path, []byte(script), 0o644)
			if out, err := exec.Command(bin, "-n", path).CombinedOutput(); err != nil {
				t.Fatalf("%s -n: %v\n%s", shell, err, out)
			}
			if shell == "zsh" {
				out, err := exec.Command(bin, "-f", "-c", `autoload -U compinit && compinit -u -D && source "$1" && print -r -- $_comps[vmhost]`, "zsh", path).CombinedOutput()
				if err != nil || strings.TrimSpace(string(out)) != "_vmhost" {
					t.Errorf("zsh does not register the completion: %v\n%s", err, out)
				}
				return
			}
			for line, want := range map[string][]string{
				"vmhost vm ":          {"list", "balloon", "delete"},
				"vmhost volume att":   {"attach"},
				"vmhost vm delete --": {"--force", "--api"},
				"vmhost ":             {"appvm", "registry", "cache"},
			} {
				out, err := exec.Command(bin, "--no-config", "-c", `source $argv[1]; complete -C $argv[2]`, path, line).CombinedOutput()
				if err != nil {
					t.Fatalf("fish: %v\n%s", err, out)
				}
				var got []string
				for _, l := range strings.Split(strings.TrimSpace(string(out)), "\n") {
					got = append(got, strings.Fields(l + " ")[0])
				}
				for _, w := range want {
					if !slices.Contains(got, w) {
						t.Errorf("fish completion of %q = %q, want %q among them", line, got, w)
					}
				}
			}
		})
	}
	if _, err := Completion("tcsh", Synopses, GlobalFlags); err == nil {
		t.Error("a completion for tcsh")
	}
}

// TestSynopsisWords: the command, verbs and flags completion and the
// manual page read from a synopsis.
func TestSynopsisWords(t *testing.T) {
	s := Synopsis{Line: "vmhost volume attach VM (--volume ID | --size-gib N) [--readonly] [--appvm --mountpoint PATH]"}
	if cmd, verbs := s.Command(); cmd != "volume" || !slices.Equal(verbs, []string{"attach"}) {
		t.Errorf("Command = %q, %q", cmd, verbs)
	}
	if f := s.Flags(); !slices.Equal(f, []string{"--volume", "--size-gib", "--readonly", "--appvm", "--mountpoint"}) {
		t.Errorf("Flags = %q", f)
	}
	s = Synopsis{Line: "vmhost events [--vm ID] [--since SEQ]"}
	if cmd, verbs := s.Command(); cmd != "events" || verbs != nil {
		t.Errorf("Command = %q, %q", cmd, verbs)
	}
	g := newGrammar([]Synopsis{s, {Line: "vmhost vm delete ID [--force]"}}, GlobalFlags)
	for _, f := range []string{"--vm", "--since", "--api", "-o"} {
		if !slices.Contains(g.valued, f) {
			t.Errorf("%s takes a value, grammar says %q", f, g.valued)
		}
	}
	if slices.Contains(g.valued, "--force") {
		t.Error("--force takes no value")
	}
}
