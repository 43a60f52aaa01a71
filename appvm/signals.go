package appvm

import (
	"strconv"
	"strings"
)

// linuxSignals are the numbers of the guest's (Linux's) signals by name,
// as signal(7) lists them for x86 and ARM; the AppVM guest is Linux
// whatever the host the API runs on. IOT, POLL and CLD are the aliases
// kill(1) accepts.
var linuxSignals = map[string]int{
	"HUP": 1, "INT": 2, "QUIT": 3, "ILL": 4, "TRAP": 5, "ABRT": 6, "IOT": 6, "BUS": 7, "FPE": 8,
	"KILL": 9, "USR1": 10, "SEGV": 11, "USR2": 12, "PIPE": 13, "ALRM": 14, "TERM": 15,
	"STKFLT": 16, "CHLD": 17, "CLD": 17, "CONT": 18, "STOP": 19, "TSTP": 20, "TTIN": 21, "TTOU": 22,
	"URG": 23, "XCPU": 24, "XFSZ": 25, "VTALRM": 26, "PROF": 27, "WINCH": 28, "IO": 29, "POLL": 29,
	"PWR": 30, "SYS": 31,
}

// The real-time signals: RTMIN is 34 (glibc and musl keep 32 and 33 for
// themselves), RTMAX 64.
const sigRTMin, sigRTMax = 34, 64

// ParseSignal reads a signal as the API takes it: a name with or without
// "SIG" (HUP, SIGHUP, any case; RTMIN+n and RTMAX-n too) or a number
// 1..64. A bad one is a 400 *vm.FieldError naming field.
func ParseSignal(field, s string) (int, error) {
	if n, err := strconv.Atoi(s); err == nil {
		if n < 1 || n > 64 {
			return 0, bad(field, "signal number %d is not in 1..64", n)
		}
		return n, nil
	}
	name := strings.TrimPrefix(strings.ToUpper(s), "SIG")
	if n, ok := linuxSignals[name]; ok {
		return n, nil
	}
	for _, rt := range []struct {
		prefix string
		base   int
		sign   int
	}{{"RTMIN", sigRTMin, 1}, {"RTMAX", sigRTMax, -1}} {
		rest, ok := strings.CutPrefix(name, rt.prefix)
		if !ok {
			continue
		}
		off := 0
		if rest != "" {
			want := "+"
			if rt.sign < 0 {
				want = "-"
			}
			d, err := strconv.Atoi(strings.TrimPrefix(rest, want))
			if !strings.HasPrefix(rest, want) || err != nil || d < 0 {
				break
			}
			off = d
		}
		if n := rt.base + rt.sign*off; n >= sigRTMin && n <= sigRTMax {
			return n, nil
		}
	}
	return 0, bad(field, "unknown signal %q: want a name such as HUP, SIGTERM or RTMIN+1, or a number 1..64", s)
}
