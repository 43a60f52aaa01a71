//go:build !linux

package chsim

import (
	"encoding/json"
	"fmt"
	"os"
)

// The guest agent runs on Linux only, so no agent is kept with a saved state elsewhere
// (see keep_linux.go).

type keptAgent struct {
	Pid       int    `json:"pid"`
	StartTime uint64 `json:"start_time"`
	Netns     bool   `json:"netns,omitempty"`
}

const keeperFlag = "--sim-keep-guest"

func (s *sim) saveGuestAgentLocked() json.RawMessage { return nil }

func (s *sim) noteSavedLocked(string) {}

func (s *sim) dropSavedLocked() {}

func (s *sim) keepGuestAgentLocked() bool { return false }

func (s *sim) adoptGuestAgentLocked(keptAgent) (*guestAgent, error) { return nil, errNotLinux }

func runKeeper([]string) int {
	fmt.Fprintln(os.Stderr, "chsim: the keeper runs on Linux only")
	return 2
}
