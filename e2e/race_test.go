//go:build linux && race

package e2e

// With -race, the vmhost binary under test is built with the race
// detector too, so the agent's own goroutines are checked end to end.
func init() { buildFlags, raceBuild = append(buildFlags, "-race"), true }
