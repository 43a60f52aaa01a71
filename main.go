// Command vmhost is a per-host VM agent: it runs Cloud Hypervisor VMs and
// AppVMs on one host and serves an authenticated JSON-over-HTTP API for
// them. The same binary is the operator's command-line client, the AppVM
// guest agent and the simulators the tests and dev mode use.
//
// The commands are listed by `vmhost help` (agentSynopses here, the
// client's in package cli): serve, doctor, key, image import, config,
// openapi, completion, man, version; the client commands; and guest,
// sim-ch, sim-qsd. serve is the default when the first argument is one of
// its flags (vmhost --dev). docs/ holds the operator's guide and the API
// reference.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"

	"vmhost/appvm/guest"
	"vmhost/chclient/chsim"
	"vmhost/cli"
	_ "vmhost/jail" // the jail's self-check (doctor, the agent's start) runs from its init
	"vmhost/qmp/qsdsim"
)

func main() {
	if code, ok := runAsInit(); ok {
		os.Exit(code)
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches a command line (without the program name) and returns the
// exit status: 0 success, 1 failure, 2 usage error.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, shortUsage)
		return 2
	}
	switch a := args[0]; {
	case a == "--version" || a == "-version":
		return versionCmd(args[1:], stdout, stderr)
	case a == "-h" || a == "--help" || a == "-help":
		fmt.Fprint(stdout, usage())
		return 0
	case cli.IsGlobalFlag(a): // vmhost -o json vm list
		return client(args, stdout, stderr)
	case strings.HasPrefix(a, "-"): // vmhost --dev
		return serve(args, stdout, stderr)
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "serve":
		return serve(rest, stdout, stderr)
	case "doctor":
		return doctorCmd(rest, stdout, stderr)
	case "key":
		return key(rest, stdout, stderr)
	case "image":
		if localImageCommand(rest, os.Getenv) {
			return image(rest, stdout, stderr)
		}
		return client(args, stdout, stderr)
	case "version":
		return versionCmd(rest, stdout, stderr)
	case "config":
		return configCmd(rest, stdout, stderr)
	case "openapi":
		return openAPICmd(rest, stdout, stderr)
	case "completion":
		return completionCmd(rest, stdout, stderr)
	case "man":
		return manCmd(rest, stdout, stderr)
	case "guest": // the AppVM guest agent (main_guest.go)
		return guest.Main(rest)
	case "sim-ch": // the Cloud Hypervisor simulator, with cloud-hypervisor's flags (docs/design.md)
		return chsim.Main(rest)
	case "sim-qsd": // the qemu-storage-daemon simulator, with its options (docs/design.md)
		return qsdsim.Main(rest)
	case "help":
		fmt.Fprint(stdout, usage())
		return 0
	}
	if slices.Contains(cli.Commands, cmd) {
		return client(args, stdout, stderr)
	}
	fmt.Fprintf(stderr, "vmhost: unknown command %q\n%s", cmd, usage())
	return 2
}

// client runs a command of the API client (package cli), until done or
// SIGINT/SIGTERM (which end `vmhost events` cleanly).
func client(args []string, stdout, stderr io.Writer) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return cli.Run(ctx, args, os.Stdin, stdout, stderr, os.Getenv)
}

// localImageCommand reports whether `vmhost image ARGS` is the offline
// import on a state directory (main_image.go) rather than a command of the
// API client: image's help, and `image import` unless it names an API
// (--api, or $VMHOST_API) without naming a state directory (--state-dir or
// --dev). An import that names neither is the local one, which then asks
// for one of them: importing through the agent (it reads PATH itself) or
// into a state directory (this process writes it) is never guessed.
func localImageCommand(args []string, getenv func(string) string) bool {
	if len(args) == 0 {
		return true // image's usage
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		return true
	case "import":
	default:
		return false
	}
	api := getenv("VMHOST_API") != ""
	for _, a := range args[1:] {
		if a == "--" {
			break
		}
		if !strings.HasPrefix(a, "-") {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
		switch name {
		case "state-dir", "dev":
			return true
		case "api":
			api = true
		}
	}
	return !api
}
