package main

import (
	"fmt"
	"io"
	"strings"

	"vmhost/cli"
)

// manCmd runs `vmhost man`: the manual page, in roff, made from the same
// synopses as `vmhost help` (dist/build-deb.sh installs it as vmhost(1)).
func manCmd(args []string, stdout, stderr io.Writer) int {
	if len(args) != 0 {
		fmt.Fprintln(stderr, "usage: vmhost man")
		return 2
	}
	io.WriteString(stdout, manPage(version))
	return 0
}

// roff escapes text for a roff line: backslashes, hyphens (which roff
// would print as hyphens, not as the minus signs of flags), and a leading
// dot or quote (which would start a request).
func roff(s string) string {
	s = strings.NewReplacer(`\`, `\e`, "-", `\-`).Replace(s)
	if strings.HasPrefix(s, ".") || strings.HasPrefix(s, "'") {
		s = `\&` + s
	}
	return s
}

// manSection writes synopses as tagged paragraphs: the command line in
// bold, its summary below.
func manSection(b *strings.Builder, title string, synopses []cli.Synopsis) {
	fmt.Fprintf(b, ".SH %s\n", title)
	for _, s := range synopses {
		fmt.Fprintf(b, ".TP\n.B %s\n%s\n", roff(s.Line), roff(s.Summary))
	}
}

// manText are the manual page's sections of prose, each a title and its
// paragraphs.
var manText = []struct{ title, text string }{
	{"DESCRIPTION", `vmhost runs Cloud Hypervisor virtual machines on one host, with their disks served by qemu-storage-daemon, and serves an authenticated JSON-over-HTTP API for them. Classic VMs boot a kernel or firmware from a copy of a qcow2 base image, with cloud-init; AppVMs run a container image's workload as the only program of a small VM.

The same static binary is the agent (vmhost serve, normally the systemd unit vmhost.service), the operator's client (the client commands, which talk to an agent's API over HTTP or a unix socket), the AppVM guest agent and the simulators that stand in for Cloud Hypervisor and qemu-storage-daemon in dev mode and in tests.

On a new host, run vmhost doctor: it checks KVM, the programs, the networks' bridges, the AppVM kernel, cgroups and the state directory, and says how to fix what is missing. vmhost serve --dev runs on any Linux machine, without root or KVM, and prints the two export lines the client needs.`},
}

// manTail are the sections after the commands.
var manTail = []struct{ title, text string }{
	{"ENVIRONMENT", `VMHOST_API
The agent the client talks to: http://HOST:PORT, https://HOST:PORT or unix:/path (default unix:/run/vmhost/api.sock, where the packaged service listens).

VMHOST_TOKEN
The API key the client sends; vmhost key add prints one, vmhost serve --dev prints its own.

VMHOST_RUN_DIR
The run directory of the agent whose consoles vmhost console attaches to (default /run/vmhost).`},
	{"FILES", `/etc/vmhost/config.json
The configuration (vmhost config default, the built-in one, as shipped; vmhost config check FILE checks an edited one).

/etc/default/vmhost
VMHOST_LISTEN, where the API listens, and VMHOST_OPTS, more serve flags.

/var/lib/vmhost
The state directory: VM records, disks, images, keys.json. Back it up whole.

/run/vmhost
The run directory: the VMs' sockets and console logs, and the API socket api.sock.

/usr/share/doc/vmhost
The guides: operating a host, AppVMs, the client, the API reference.`},
	{"EXIT STATUS", `0 on success; 1 when the command failed (the API answered an error, printed as CODE: message, or the agent could not be reached; vmhost doctor: real VMs cannot run here); 2 for a usage error.`},
	{"SEE ALSO", `systemctl(1), journalctl(1), cloud-hypervisor, qemu-storage-daemon(1), /usr/share/doc/vmhost/operating.md.gz`},
}

// manPara writes paragraphs (blank-line separated); in a section whose
// paragraphs come in pairs of a one-line tag and its text (ENVIRONMENT,
// FILES), the tag is set as a tagged paragraph.
func manPara(b *strings.Builder, text string, tagged bool) {
	for _, p := range strings.Split(text, "\n\n") {
		if tag, body, ok := strings.Cut(p, "\n"); ok && tagged {
			fmt.Fprintf(b, ".TP\n.B %s\n%s\n", roff(tag), roff(body))
			continue
		}
		fmt.Fprintf(b, ".PP\n%s\n", roff(p))
	}
}

// manPage is vmhost(1).
func manPage(version string) string {
	var b strings.Builder
	fmt.Fprintf(&b, ".TH VMHOST 1 \"\" \"vmhost %s\" \"vmhost manual\"\n", roff(version))
	// No hyphenation and a ragged right: command lines stay whole.
	b.WriteString(".nh\n.ad l\n")
	b.WriteString(".SH NAME\nvmhost \\- per\\-host agent for Cloud Hypervisor VMs and AppVMs, and its client\n")
	b.WriteString(".SH SYNOPSIS\n.B vmhost\n.I command\n.RI [ arguments ]\n")
	for _, s := range manText {
		fmt.Fprintf(&b, ".SH %s\n", s.title)
		manPara(&b, s.text, false)
	}
	manSection(&b, "AGENT AND HOST COMMANDS", agentSynopses)
	manSection(&b, "CLIENT COMMANDS", cli.Synopses)
	b.WriteString(".PP\nThe client talks to the agent at \\-\\-api (or $VMHOST_API) with the key of \\-\\-token (or $VMHOST_TOKEN). " +
		"Lists print aligned tables; \\-o json prints the API's answer unchanged.\n")
	manSection(&b, "CLIENT FLAGS", cli.GlobalFlags)
	b.WriteString(".PP\nClient flags may come before the command or after its arguments.\n")
	for _, s := range manTail {
		fmt.Fprintf(&b, ".SH %s\n", s.title)
		manPara(&b, s.text, s.title == "ENVIRONMENT" || s.title == "FILES")
	}
	return b.String()
}
