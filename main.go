// Command vmhost is a per-host VM agent: it runs Cloud Hypervisor VMs and
// AppVMs on one host and serves an authenticated JSON-over-HTTP API for them.
//
// Subcommands:
//
//	vmhost serve --listen ADDR --state-dir DIR --run-dir DIR [--config FILE] [--dev]
//	vmhost key add --state-dir DIR --name NAME --scope read|readwrite [--allow PATTERN]...
//	vmhost key list --state-dir DIR
//	vmhost key remove --state-dir DIR --name NAME
//	vmhost image import --state-dir DIR --id ID FILE
//	vmhost version     (also --version)
//	vmhost guest ...   (the AppVM guest agent; also what runs as PID 1)
//	vmhost sim-ch ...  (Cloud Hypervisor simulator)
//	vmhost sim-qsd ... (qemu-storage-daemon simulator)
//
// serve is the default when the first argument is a flag or absent. See
// README.md for the configuration file and the API.
package main

import (
	"fmt"
	"io"
	"os"
	"strings"

	"vmhost/appvm/guest"
	"vmhost/chclient/chsim"
	"vmhost/qmp/qsdsim"
)

const usage = `usage:
  vmhost serve --listen ADDR --state-dir DIR --run-dir DIR [--config FILE]
  vmhost serve --dev [--listen ADDR] [--config FILE]
  vmhost key add --state-dir DIR --name NAME --scope read|readwrite [--allow 'GET /api/vms/{id}']...
  vmhost key list --state-dir DIR
  vmhost key remove --state-dir DIR --name NAME
  vmhost image import --state-dir DIR --id ID [--ignore-owners] [--skip-devices] FILE
  vmhost version
Run "vmhost COMMAND -h" for the flags of a command.
Also: guest, sim-ch, sim-qsd (the AppVM guest agent and the simulators; see README.md).
`

func main() {
	if code, ok := runAsInit(); ok {
		os.Exit(code)
	}
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run dispatches a command line (without the program name) and returns the
// exit status: 0 success, 1 failure, 2 usage error.
func run(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && (args[0] == "--version" || args[0] == "-version") {
		return versionCmd(args[1:], stdout, stderr)
	}
	if len(args) == 0 || strings.HasPrefix(args[0], "-") && args[0] != "-h" && args[0] != "--help" && args[0] != "-help" {
		return serve(args, stdout, stderr)
	}
	cmd, rest := args[0], args[1:]
	switch cmd {
	case "serve":
		return serve(rest, stdout, stderr)
	case "key":
		return key(rest, stdout, stderr)
	case "image":
		return image(rest, stdout, stderr)
	case "version":
		return versionCmd(rest, stdout, stderr)
	case "guest": // the AppVM guest agent (main_guest.go)
		return guest.Main(rest)
	case "sim-ch": // the Cloud Hypervisor simulator, with cloud-hypervisor's flags (DESIGN §6)
		return chsim.Main(rest)
	case "sim-qsd": // the qemu-storage-daemon simulator, with its options (DESIGN §6)
		return qsdsim.Main(rest)
	case "help", "-h", "-help", "--help":
		fmt.Fprint(stdout, usage)
		return 0
	}
	fmt.Fprintf(stderr, "vmhost: unknown command %q\n%s", cmd, usage)
	return 2
}
