package cli

import (
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
)

// Synopsis is one command line of vmhost's usage: what `vmhost help`, the
// manual page (`vmhost man`) and shell completion (`vmhost completion`)
// are made from, so the three cannot disagree.
type Synopsis struct {
	// Line is the command line: "vmhost", the command, its verbs (a|b for
	// either), then its arguments (upper case) and flags.
	Line string
	// Summary says what it does, in a few words.
	Summary string
	// Routes are the API routes the command calls, as the API's route
	// table spells them (client commands only).
	Routes []string
}

// Command returns the command and the verbs of the synopsis: "vm" and
// ["start" "stop"] for "vmhost vm start|stop ID".
func (s Synopsis) Command() (cmd string, verbs []string) {
	f := strings.Fields(s.Line)
	if len(f) < 2 {
		return "", nil
	}
	cmd = f[1]
	if len(f) > 2 && verbWord.MatchString(f[2]) {
		verbs = strings.Split(f[2], "|")
	}
	return cmd, verbs
}

// Flags returns the flags the synopsis names ("--force", "-f").
func (s Synopsis) Flags() []string {
	var out []string
	for _, m := range flagWord.FindAllStringSubmatch(s.Line, -1) {
		if !slices.Contains(out, m[2]) {
			out = append(out, m[2])
		}
	}
	return out
}

var (
	verbWord = regexp.MustCompile(`^[a-z][a-z0-9-]*(\|[a-z][a-z0-9-]*)*$`)
	flagWord = regexp.MustCompile(`(^|[\s\[(|])(--?[a-z][a-z0-9-]*)`)
)

// Synopses are the client's command lines, in the order usage shows them.
var Synopses = []Synopsis{
	{"vmhost list [--label KEY[=VALUE]]…", "list the VMs of both families (--label: only those with the label)", []string{"GET /api/vms", "GET /api/appvm/vms"}},
	{"vmhost vm list [--label KEY[=VALUE]]…", "list the classic VMs", []string{"GET /api/vms"}},
	{"vmhost vm get ID", "show a classic VM (-o json: its whole view)", []string{"GET /api/vms/{id}"}},
	{"vmhost vm create -f FILE [--from-snapshot SNAPSHOT]", "create a classic VM from a JSON body (- reads stdin); its disks copies of a snapshot's", []string{"POST /api/vms"}},
	{"vmhost vm start|stop|shutdown|pause|resume|reboot ID [--cold]", "a lifecycle action (accepted, not done: read the VM after); start --cold discards a saved state and boots", []string{
		"POST /api/vms/{id}/start", "POST /api/vms/{id}/stop", "POST /api/vms/{id}/shutdown",
		"POST /api/vms/{id}/pause", "POST /api/vms/{id}/resume", "POST /api/vms/{id}/reboot"}},
	{"vmhost vm balloon ID MIB", "set the memory the balloon reclaims (0 deflates)", []string{"POST /api/vms/{id}/balloon"}},
	{"vmhost vm label ID KEY=VALUE|KEY-…", "set (KEY=VALUE) and remove (KEY-) labels of a classic VM", []string{"PATCH /api/vms/{id}/labels"}},
	{"vmhost vm delete ID [--force]", "delete a classic VM (--force: also a running one)", []string{"DELETE /api/vms/{id}"}},
	{"vmhost vm wait ID --for STATE[,STATE…] [--timeout 60s]", "wait until the VM is in one of the display states (or deleted)", []string{"GET /api/vms/{id}/wait"}},
	{"vmhost vm console-log ID [-f] [--tail-bytes N]", "print the serial console log (-f: and follow it)", []string{"GET /api/vms/{id}/console"}},
	{"vmhost vm suspend ID", "save its memory and device state and stop it (a start resumes it)", []string{"POST /api/vms/{id}/suspend"}},
	{"vmhost vm snapshot ID [--id SNAPSHOT] [--memory]", "copy its disks (and with --memory its running state) into a snapshot", []string{"POST /api/vms/{id}/snapshots"}},
	{"vmhost vm restore ID SNAPSHOT", "make a stopped VM's disks (and saved state) the snapshot's", []string{"POST /api/vms/{id}/restore"}},
	{"vmhost appvm list [--label KEY[=VALUE]]…", "list the AppVMs", []string{"GET /api/appvm/vms"}},
	{"vmhost appvm get ID", "show an AppVM", []string{"GET /api/appvm/vms/{id}"}},
	{"vmhost appvm create -f FILE [--from-snapshot SNAPSHOT]", "create an AppVM from a JSON body", []string{"POST /api/appvm/vms", "GET /api/appvm/vms/{id}"}},
	{"vmhost appvm start|stop|shutdown|pause|resume|reboot ID [--cold]", "a lifecycle action", []string{
		"POST /api/appvm/vms/{id}/start", "POST /api/appvm/vms/{id}/stop", "POST /api/appvm/vms/{id}/shutdown",
		"POST /api/appvm/vms/{id}/pause", "POST /api/appvm/vms/{id}/resume", "POST /api/appvm/vms/{id}/reboot"}},
	{"vmhost appvm edit ID -f FILE [--restart]", "change the workload spec (a JSON object of the fields to change)", []string{"PATCH /api/appvm/vms/{id}/spec"}},
	{"vmhost appvm redeploy ID", "rebuild the root disk from the image's current build and boot it", []string{"POST /api/appvm/vms/{id}/redeploy"}},
	{"vmhost appvm balloon ID MIB", "set the memory the balloon reclaims", []string{"POST /api/appvm/vms/{id}/balloon"}},
	{"vmhost appvm label ID KEY=VALUE|KEY-…", "set and remove labels of an AppVM", []string{"PATCH /api/appvm/vms/{id}/labels"}},
	{"vmhost appvm delete ID [--force]", "delete an AppVM", []string{"DELETE /api/appvm/vms/{id}"}},
	{"vmhost appvm suspend ID", "save its memory and device state and stop it", []string{"POST /api/appvm/vms/{id}/suspend"}},
	{"vmhost appvm snapshot ID [--id SNAPSHOT] [--memory]", "copy its disks (and its running state) into a snapshot", []string{"POST /api/appvm/vms/{id}/snapshots"}},
	{"vmhost appvm restore ID SNAPSHOT", "make a stopped AppVM's disks (and saved state) the snapshot's", []string{"POST /api/appvm/vms/{id}/restore"}},
	{"vmhost appvm exec [-i] [-t] [--timeout D] [-e K=V] [-u USER] [-w DIR] ID -- CMD ARGS...", "run a command beside the workload; exits with its status (-i: stdin, -t: a terminal)", []string{"POST /api/appvm/vms/{id}/exec"}},
	{"vmhost appvm cp ID:/PATH LOCAL | LOCAL ID:/DIR", "copy files out of or into an AppVM (LOCAL - : a tar archive on stdout or stdin)", []string{"GET /api/appvm/vms/{id}/files", "PUT /api/appvm/vms/{id}/files"}},
	{"vmhost appvm kill ID [--signal SIG]", "send a signal to the workload (default KILL)", []string{"POST /api/appvm/vms/{id}/signal"}},
	{"vmhost appvm wait ID --for STATE[,STATE…] [--timeout 60s]", "wait until the AppVM is in one of the display states (or deleted)", []string{"GET /api/appvm/vms/{id}/wait"}},
	{"vmhost appvm console-log ID [-f] [--tail-bytes N]", "print the serial console log (-f: and follow it)", []string{"GET /api/appvm/vms/{id}/console"}},
	{"vmhost appvm logs ID [-f] [--tail N] [--since SEQ] [--stream stdout|stderr]", "print the workload's output, each stream on its own (-f: and follow it)", []string{"GET /api/appvm/vms/{id}/logs"}},
	{"vmhost run [--rm] [--name ID] --image IMAGE [--vcpus N] [--memory MIB] [--disk-gib N] [--env K=V] [--secret-env K=V] [--restart POLICY] [--stop-grace SECS] [--workdir DIR] [--user USER] [--network ID] [--ip ADDR/PREFIX --gateway GW] [--hostname NAME] [-- CMD ARGS…]",
		"run an AppVM as a command: its output on this one's, SIGINT/SIGTERM shut it down, its exit status is this one's", []string{
			"GET /api/appvm/images/{id}", "POST /api/appvm/vms", "GET /api/appvm/vms/{id}", "POST /api/appvm/vms/{id}/start",
			"GET /api/appvm/vms/{id}/logs", "GET /api/appvm/vms/{id}/wait", "POST /api/appvm/vms/{id}/shutdown",
			"POST /api/appvm/vms/{id}/stop", "DELETE /api/appvm/vms/{id}"}},
	{"vmhost snapshot list [--vm ID]", "list the snapshots", []string{"GET /api/snapshots"}},
	{"vmhost snapshot get ID", "show a snapshot", []string{"GET /api/snapshots/{id}"}},
	{"vmhost snapshot delete ID", "delete a snapshot", []string{"DELETE /api/snapshots/{id}"}},
	{"vmhost volume list", "list the first-class volumes", []string{"GET /api/volumes"}},
	{"vmhost volume get ID", "show a volume", []string{"GET /api/volumes/{id}"}},
	{"vmhost volume create --size-gib N [--id ID] [--format raw|ext4]", "create a volume", []string{"POST /api/volumes"}},
	{"vmhost volume delete ID", "delete a volume (and its data)", []string{"DELETE /api/volumes/{id}"}},
	{"vmhost volume attach VM (--volume ID | --size-gib N) [--readonly] [--appvm --mountpoint PATH]", "attach a volume, or a new VM-owned one", []string{"POST /api/vms/{id}/volumes", "POST /api/appvm/vms/{id}/volumes"}},
	{"vmhost volume detach VM VOL [--appvm]", "detach a volume (a VM-owned one becomes first-class)", []string{"DELETE /api/vms/{id}/volumes/{vol}", "DELETE /api/appvm/vms/{id}/volumes/{vol}"}},
	{"vmhost image list", "list the AppVM images", []string{"GET /api/appvm/images"}},
	{"vmhost image get ID", "show an AppVM image and its import", []string{"GET /api/appvm/images/{id}"}},
	{"vmhost image import --id ID PATH", "import an image the agent reads at PATH on its host", []string{"POST /api/appvm/images"}},
	{"vmhost image delete ID", "delete an AppVM image", []string{"DELETE /api/appvm/images/{id}"}},
	{"vmhost registry list", "list the registry images a classic create can name", []string{"GET /api/registry/images"}},
	{"vmhost registry get ID", "show a registry image", []string{"GET /api/registry/images/{id}"}},
	{"vmhost cache list", "list the verified image downloads", []string{"GET /api/images/cache"}},
	{"vmhost cache delete DIGEST", "remove a cached image", []string{"DELETE /api/images/cache/{digest}"}},
	{"vmhost network list", "list the host networks and their bridges", []string{"GET /api/networks"}},
	{"vmhost host", "show the agent and what the host can still take (admission's numbers)", []string{"GET /api/host"}},
	{"vmhost host pci", "list the host's PCI devices and their passthrough readiness", []string{"GET /api/host/pci"}},
	{"vmhost events [--vm ID] [--label KEY[=VALUE]]… [--since SEQ]", "follow the event stream (reconnects by itself)", []string{"GET /api/events"}},
	{"vmhost metrics", "print the Prometheus metrics", []string{"GET /metrics"}},
	{"vmhost health", "say whether the agent is ready (needs no key)", []string{"GET /healthz"}},
	{"vmhost console ID [--run-dir DIR]", "attach to a VM's serial console, on the agent's host (detach: Ctrl-] then q)", nil},
}

// GlobalFlags are the flags every client command takes, before or after
// its arguments.
var GlobalFlags = []Synopsis{
	{"--api URL", "http://HOST:PORT, https://HOST:PORT or unix:/path (default $VMHOST_API, else " + DefaultAPI + ")", nil},
	{"--token TOKEN", "the API key (default $VMHOST_TOKEN); prefer the variable or --token-file: arguments show in ps", nil},
	{"--token-file FILE", "a file holding the API key", nil},
	{"--cacert FILE", "PEM CA bundle that signed the agent's certificate (https; default: the system roots)", nil},
	{"--cert FILE --key FILE", "client certificate and key for mutual TLS", nil},
	{"-o table|json", "output: aligned tables (default), or the API's body unchanged", nil},
}

// IsGlobalFlag reports whether arg is one of GlobalFlags ("--api",
// "-o=json", …), so that a command line starting with it is the client's.
func IsGlobalFlag(arg string) bool {
	name, _, _ := strings.Cut(strings.TrimLeft(arg, "-"), "=")
	switch name {
	case "api", "token", "token-file", "cacert", "cert", "key", "o":
		return strings.HasPrefix(arg, "-")
	}
	return false
}

// summaryColumn is where WriteUsage starts the summaries; a longer
// command line puts its summary on the next line.
const summaryColumn = 44

// WriteUsage writes synopses as the command line, then its summary from
// summaryColumn on (on a line of its own after a long command line).
func WriteUsage(w io.Writer, synopses []Synopsis) {
	for _, s := range synopses {
		line := "  " + s.Line
		if len(line) >= summaryColumn-1 {
			line += "\n"
			fmt.Fprintf(w, "%s%s%s\n", line, strings.Repeat(" ", summaryColumn), s.Summary)
			continue
		}
		fmt.Fprintf(w, "%-*s%s\n", summaryColumn, line, s.Summary)
	}
}

// Usage is the client's part of vmhost's usage text.
var Usage = func() string {
	var b strings.Builder
	b.WriteString("The client (talks to the API at --api, $VMHOST_API, default " + DefaultAPI + "):\n")
	WriteUsage(&b, Synopses)
	b.WriteString("Client flags, before or after the command:\n")
	WriteUsage(&b, GlobalFlags)
	return b.String()
}()

// commandUsage is the usage of one client command: its synopses and the
// client flags.
func commandUsage(cmd string) string {
	var b strings.Builder
	b.WriteString("usage:\n")
	var lines []Synopsis
	for _, s := range Synopses {
		if c, _ := s.Command(); c == cmd {
			lines = append(lines, s)
		}
	}
	WriteUsage(&b, lines)
	b.WriteString("Client flags, before or after the command:\n")
	WriteUsage(&b, GlobalFlags)
	return b.String()
}
