package guest

import (
	"os"
	"strings"
	"sync"
)

// switchesUsers reports whether the agent may act as other users: run the
// workload as its user, give files their owners. It may as root of a user
// namespace that maps every id (a guest's, or a host's as root). The
// simulator's rootless agent is root of a namespace that maps one id, its
// user's, where no other user exists: it runs everything as itself.
var switchesUsers = sync.OnceValue(func() bool {
	if os.Geteuid() != 0 {
		return false
	}
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return true // no /proc yet: a guest's initial namespace
	}
	return fullIDMap(string(b))
})

// fullIDMap reports whether a uid_map maps every id to itself, as the
// initial user namespace's does.
func fullIDMap(m string) bool {
	f := strings.Fields(m)
	return len(f) == 3 && f[0] == "0" && f[1] == "0" && f[2] == "4294967295"
}
