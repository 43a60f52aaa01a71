package main

import (
	"fmt"
	"io"

	"vmhost/config"
)

const configUsage = `usage:
  vmhost config default        print the built-in configuration (what no --config means)
  vmhost config check FILE     load FILE as serve would, and say what is wrong with it
`

// configCmd runs `vmhost config`: the packaged /etc/vmhost/config.json is
// `vmhost config default` (dist/build-deb.sh), and an edited file can be
// checked before a restart.
func configCmd(args []string, stdout, stderr io.Writer) int {
	switch {
	case len(args) == 1 && args[0] == "default":
		b, err := config.Default().Marshal()
		if err != nil {
			fmt.Fprintf(stderr, "vmhost config default: %v\n", err)
			return 1
		}
		stdout.Write(b)
		return 0
	case len(args) == 2 && args[0] == "check":
		if _, err := config.Load(args[1]); err != nil {
			fmt.Fprintf(stderr, "vmhost config check: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "%s: ok\n", args[1])
		return 0
	case len(args) == 1 && (args[0] == "-h" || args[0] == "--help" || args[0] == "help"):
		fmt.Fprint(stdout, configUsage)
		return 0
	}
	fmt.Fprint(stderr, configUsage)
	return 2
}
