package metrics

import (
	"bytes"
	"os"
	"strconv"

	"golang.org/x/sys/unix"
)

// userHZ is the unit of /proc/<pid>/stat's times: USER_HZ, 100 on every
// Linux architecture Go supports.
const userHZ = 100

func writeProcess(w *Writer) {
	stat, err := os.ReadFile("/proc/self/stat")
	if err != nil {
		return
	}
	// The fields after the command name (which may hold spaces and
	// parentheses) start with field 3, the state.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return
	}
	f := bytes.Fields(stat[i+1:])
	if len(f) < 22 {
		return
	}
	num := func(field int) float64 {
		v, _ := strconv.ParseFloat(string(f[field-3]), 64)
		return v
	}
	w.Family("process_cpu_seconds_total", Counter, "Total user and system CPU time spent in seconds.")
	w.Sample("process_cpu_seconds_total", (num(14)+num(15))/userHZ)
	w.Family("process_resident_memory_bytes", Gauge, "Resident memory size in bytes.")
	w.Sample("process_resident_memory_bytes", num(24)*float64(os.Getpagesize()))
	w.Family("process_virtual_memory_bytes", Gauge, "Virtual memory size in bytes.")
	w.Sample("process_virtual_memory_bytes", num(23))
	if btime := bootTime(); btime > 0 {
		w.Family("process_start_time_seconds", Gauge, "Start time of the process since unix epoch in seconds.")
		w.Sample("process_start_time_seconds", btime+num(22)/userHZ)
	}
	if fds, err := os.ReadDir("/proc/self/fd"); err == nil {
		w.Family("process_open_fds", Gauge, "Number of open file descriptors.")
		w.Sample("process_open_fds", float64(len(fds)))
	}
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) == nil {
		w.Family("process_max_fds", Gauge, "Maximum number of open file descriptors.")
		w.Sample("process_max_fds", float64(lim.Cur))
	}
}

// bootTime is the btime of /proc/stat (seconds since the epoch), or 0.
func bootTime() float64 {
	data, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	for line := range bytes.Lines(data) {
		if v, ok := bytes.CutPrefix(line, []byte("btime ")); ok {
			n, _ := strconv.ParseFloat(string(bytes.TrimSpace(v)), 64)
			return n
		}
	}
	return 0
}
