package main

import (
	"fmt"
	"io"
	"runtime"
	"runtime/debug"
)

// version is the release, set at build time:
//
//	go build -ldflags "-X main.version=1.4.0"
//
// A build without it says "dev".
var version = "dev"

// commit is the commit to print when the build recorded none: go build
// stamps vcs.revision only in a plain git clone (not in a git worktree,
// whose .git is a file, nor with -buildvcs=false), so dist/build-deb.sh
// also passes -X main.commit=$(git rev-parse HEAD).
var commit = ""

// buildInfo is what `vmhost version` prints.
type buildInfo struct {
	Version  string
	Commit   string // vcs.revision, "" when the build recorded none
	Modified bool   // vcs.modified: the work tree had uncommitted changes
	Go       string
}

// readBuildInfo gathers the version, the commit the Go tool recorded
// (vcs.revision and vcs.modified; else the commit set with -X) and the Go
// version.
func readBuildInfo() buildInfo {
	b := buildInfo{Version: version, Commit: commit, Go: runtime.Version()}
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				b.Commit = s.Value
			case "vcs.modified":
				b.Modified = s.Value == "true"
			}
		}
	}
	return b
}

func (b buildInfo) String() string {
	commit := b.Commit
	switch {
	case commit == "":
		commit = "unknown"
	case b.Modified:
		commit += " (modified)"
	}
	return fmt.Sprintf("vmhost %s\ncommit %s\ngo %s\n", b.Version, commit, b.Go)
}

// versionCmd runs `vmhost version` and `vmhost --version`.
func versionCmd(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		fmt.Fprintf(stderr, "vmhost version: unexpected argument %q\n", args[0])
		return 2
	}
	fmt.Fprint(stdout, readBuildInfo())
	return 0
}
