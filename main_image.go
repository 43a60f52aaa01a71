package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os/signal"
	"path/filepath"
	"syscall"

	"vmhost/appvm"
	"vmhost/config"
)

const imageUsage = `usage:
  vmhost image import --state-dir DIR --id ID [--config FILE] [--ignore-owners] [--skip-devices] FILE
  vmhost image import --api URL --id ID PATH     (through a running agent, which reads PATH)
  vmhost image list|get ID|delete ID [--api URL] (through the API)
The first form is the offline import:
FILE is an OCI image layout (a directory or a tar of one) or a docker save
tarball. The import runs in the foreground, writes the AppVM image catalog
of DIR (safe while vmhost serve runs on it) and prints the image as JSON.
--config names the host configuration whose image_import_max_bytes and
image_import_max_entries apply (default: the built-in limits). SIGINT or
SIGTERM stops the import, removes what it staged and exits 1; a second
signal ends the process at once.
`

// image runs `vmhost image import`: the same import the API runs in the
// background, in the foreground.
func image(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, imageUsage)
		return 2
	}
	switch args[0] {
	case "import":
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, imageUsage)
		return 0
	default:
		fmt.Fprintf(stderr, "vmhost image: unknown subcommand %q\n%s", args[0], imageUsage)
		return 2
	}
	fs := flag.NewFlagSet("vmhost image import", flag.ContinueOnError)
	fs.SetOutput(stderr)
	stateDir := fs.String("state-dir", "", "state directory of the agent")
	dev := fs.Bool("dev", false, "use the state directory of serve --dev ("+devStateDir+")")
	id := fs.String("id", "", "image id (the VM id pattern)")
	configPath := fs.String("config", "", "host configuration file (JSON) whose image import limits apply; none = built-in defaults")
	ignoreOwners := fs.Bool("ignore-owners", false, "leave files owned by the importing user when it may not chown (non-root)")
	skipDevices := fs.Bool("skip-devices", false, "leave out device nodes the importing user may not create (non-root)")
	if err := fs.Parse(args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if *dev {
		*stateDir = devStateDir
	}
	if *stateDir == "" || *id == "" || fs.NArg() != 1 {
		fmt.Fprint(stderr, "vmhost image import: --state-dir (or --dev; or --api to import through an agent), --id and one FILE are required\n"+imageUsage)
		return 2
	}
	src, err := filepath.Abs(fs.Arg(0))
	if err != nil {
		fmt.Fprintf(stderr, "vmhost image import: %v\n", err)
		return 2
	}
	cfg := config.Default()
	if *configPath != "" {
		if cfg, err = config.Load(*configPath); err != nil {
			fmt.Fprintf(stderr, "vmhost image import: %v\n", err)
			return 1
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	// Once a signal has cancelled the import, a second one takes its
	// default action, should the import not stop.
	go func() { <-ctx.Done(); stop() }()
	imp := appvm.NewImporter(appvm.Catalog{Dir: filepath.Join(*stateDir, "appvm-images")},
		appvm.ImportOptions{IgnoreOwners: *ignoreOwners, SkipDevices: *skipDevices,
			MaxBytes: cfg.ImageImportMaxBytes, MaxEntries: cfg.ImageImportMaxEntries})
	img, err := imp.Import(ctx, &appvm.ImportRequest{ID: *id, Path: src})
	if err != nil && ctx.Err() != nil && errors.Is(err, context.Canceled) {
		fmt.Fprintf(stderr, "vmhost image import: interrupted (%v): the import of %q was stopped and what it staged removed\n", context.Cause(ctx), *id)
		return 1
	}
	if err != nil {
		fmt.Fprintf(stderr, "vmhost image import: %v\n", err)
		return 1
	}
	out, err := json.MarshalIndent(img, "", "  ")
	if err != nil {
		fmt.Fprintf(stderr, "vmhost image import: %v\n", err)
		return 1
	}
	fmt.Fprintf(stdout, "%s\n", out)
	return 0
}
