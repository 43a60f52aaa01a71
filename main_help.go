package main

import (
	"fmt"
	"io"
	"strings"

	"vmhost/cli"
)

// agentSynopses are the command lines of the agent and of what an operator
// runs on its host; the client's are cli.Synopses. `vmhost help`, the
// manual page and the completion scripts are all made from the two.
var agentSynopses = []cli.Synopsis{
	{Line: "vmhost serve --listen ADDR --state-dir DIR --run-dir DIR [--config FILE] [--simulate ch,qsd|ch|qsd|none] [--tls-cert FILE --tls-key FILE] [--tls-client-ca FILE]", Summary: "run the agent (as root, under systemd: dist/vmhost.service)"},
	{Line: "vmhost serve --dev [--listen ADDR] [--config FILE]", Summary: "run the agent in dev mode: simulators, ./vmhost-dev, no root needed"},
	{Line: "vmhost doctor [--config FILE] [--state-dir DIR] [-o table|json]", Summary: "check that this host can run real VMs, and say how to fix what it lacks"},
	{Line: "vmhost key add --state-dir DIR --name NAME --scope read|readwrite [--allow PATTERN]", Summary: "add an API key and print its token (once); --allow repeats"},
	{Line: "vmhost key list --state-dir DIR", Summary: "list the API keys (never their tokens)"},
	{Line: "vmhost key remove --state-dir DIR --name NAME", Summary: "remove an API key"},
	{Line: "vmhost image import (--state-dir DIR | --dev) --id ID [--config FILE] [--ignore-owners] [--skip-devices] FILE", Summary: "import an AppVM image into a state directory, without the agent"},
	{Line: "vmhost config default", Summary: "print the built-in configuration"},
	{Line: "vmhost config check FILE", Summary: "check a configuration file as serve reads it (errors name line and column)"},
	{Line: "vmhost openapi", Summary: "print the API's OpenAPI 3.1 document"},
	{Line: "vmhost completion bash|zsh|fish", Summary: "print a shell completion script"},
	{Line: "vmhost man", Summary: "print the manual page (roff)"},
	{Line: "vmhost version", Summary: "print the version, the commit and the Go version"},
}

// allSynopses is every command line, the agent's first.
func allSynopses() []cli.Synopsis {
	return append(append([]cli.Synopsis{}, agentSynopses...), cli.Synopses...)
}

// shortUsage is what a bare `vmhost` prints: where to start.
const shortUsage = `usage: vmhost COMMAND [ARGUMENTS]
  vmhost serve --dev     run the agent in dev mode (any Linux machine: simulators, no root, no KVM)
  vmhost doctor          check that this host can run real VMs, and how to fix what it lacks
  vmhost list            list the VMs (the client; serve --dev prints the VMHOST_API and VMHOST_TOKEN it needs)
  vmhost help            every command
`

// usage is `vmhost help`.
func usage() string {
	var b strings.Builder
	b.WriteString("vmhost: a per-host agent for Cloud Hypervisor VMs and AppVMs, and its client.\n\n")
	b.WriteString("The agent and its host:\n")
	cli.WriteUsage(&b, agentSynopses)
	b.WriteString("\n" + cli.Usage)
	b.WriteString(`
Also: guest, sim-ch, sim-qsd (the AppVM guest agent and the simulators).
Run "vmhost COMMAND -h" for the flags of a command; "vmhost man" is the
manual page. The guides and the API reference are in docs/ (installed in
/usr/share/doc/vmhost).
`)
	return b.String()
}

// completionCmd runs `vmhost completion SHELL`.
func completionCmd(args []string, stdout, stderr io.Writer) int {
	if len(args) != 1 {
		fmt.Fprintf(stderr, "usage: vmhost completion %s\n", strings.Join(cli.Shells, "|"))
		return 2
	}
	script, err := cli.Completion(args[0], allSynopses(), cli.GlobalFlags)
	if err != nil {
		fmt.Fprintf(stderr, "vmhost completion: %v\n", err)
		return 2
	}
	io.WriteString(stdout, script)
	return 0
}
