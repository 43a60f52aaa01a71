package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"vmhost/api"
	"vmhost/auth"
)

// checkAllow refuses allowlist entries that name no route of the API: such
// an entry would match nothing, which is never what the operator meant
// (a concrete path like "GET /api/vms/vm1" is the usual mistake).
func checkAllow(allow []string) error {
	var known []string
	for _, r := range api.Routes() {
		known = append(known, r.Pattern)
	}
	for _, a := range allow {
		if !slices.Contains(known, a) {
			return fmt.Errorf("--allow %q is not a route of the API; routes are spelled exactly as:\n  %s", a, strings.Join(known, "\n  "))
		}
	}
	return nil
}

const keyUsage = `usage:
  vmhost key add --state-dir DIR --name NAME --scope read|readwrite [--allow 'GET /api/vms/{id}']...
  vmhost key list --state-dir DIR
  vmhost key remove --state-dir DIR --name NAME
--dev instead of --state-dir uses the state directory of "vmhost serve --dev".
A running server picks up changes on SIGHUP.
`

// keysFile is where the keys of a state directory live.
func keysFile(stateDir string) string { return filepath.Join(stateDir, "keys.json") }

// stringList is a repeatable string flag.
type stringList []string

func (l *stringList) String() string     { return strings.Join(*l, ", ") }
func (l *stringList) Set(v string) error { *l = append(*l, v); return nil }

func key(args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fmt.Fprint(stderr, keyUsage)
		return 2
	}
	sub, args := args[0], args[1:]
	fs := flag.NewFlagSet("vmhost key "+sub, flag.ContinueOnError)
	fs.SetOutput(stderr)
	stateDir := fs.String("state-dir", "", "state directory holding keys.json")
	dev := fs.Bool("dev", false, "use the state directory of serve --dev ("+devStateDir+")")
	var name, scope *string
	var allow stringList
	switch sub {
	case "add":
		name = fs.String("name", "", "key name (letters, digits, _ . -)")
		scope = fs.String("scope", "", "read or readwrite")
		fs.Var(&allow, "allow", "route pattern the key may call, as the API spells it (repeatable; none = every route)")
	case "remove":
		name = fs.String("name", "", "name of the key to remove")
	case "list":
	case "-h", "-help", "--help", "help":
		fmt.Fprint(stdout, keyUsage)
		return 0
	default:
		fmt.Fprintf(stderr, "vmhost key: unknown subcommand %q\n%s", sub, keyUsage)
		return 2
	}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "vmhost key %s: unexpected argument %q\n", sub, fs.Arg(0))
		return 2
	}
	if *dev && *stateDir == "" {
		*stateDir = devStateDir
	}
	if *stateDir == "" {
		fmt.Fprintf(stderr, "vmhost key %s: --state-dir is required\n", sub)
		return 2
	}
	if name != nil && *name == "" {
		fmt.Fprintf(stderr, "vmhost key %s: --name is required\n", sub)
		return 2
	}
	path := keysFile(*stateDir)

	switch sub {
	case "add":
		if *scope != string(auth.ScopeRead) && *scope != string(auth.ScopeReadWrite) {
			fmt.Fprintf(stderr, "vmhost key add: --scope must be read or readwrite, not %q\n", *scope)
			return 2
		}
		if err := checkAllow(allow); err != nil {
			fmt.Fprintf(stderr, "vmhost key add: %v\n", err)
			return 2
		}
		token, err := auth.Add(path, *name, auth.Scope(*scope), allow)
		if err != nil {
			fmt.Fprintf(stderr, "vmhost key add: %v\n", err)
			return 1
		}
		// The token alone on stdout, so scripts can capture it; it is
		// stored nowhere and cannot be shown again.
		fmt.Fprintln(stdout, token)
		fmt.Fprintf(stderr, "key %q added; it is shown only this once. A running server picks it up on SIGHUP.\n", *name)
	case "remove":
		if err := auth.Remove(path, *name); err != nil {
			fmt.Fprintf(stderr, "vmhost key remove: %v\n", err)
			return 1
		}
		fmt.Fprintf(stderr, "key %q removed. A running server drops it on SIGHUP.\n", *name)
	case "list":
		keys, err := auth.List(path)
		if err != nil {
			fmt.Fprintf(stderr, "vmhost key list: %v\n", err)
			return 1
		}
		tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tSCOPE\tCREATED\tALLOW")
		for _, k := range keys {
			allowed := "*"
			if len(k.Allow) > 0 {
				allowed = strings.Join(k.Allow, ", ")
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", k.Name, k.Scope, k.CreatedAt.UTC().Format(time.RFC3339), allowed)
		}
		tw.Flush()
	}
	return 0
}
