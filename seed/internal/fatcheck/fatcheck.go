// Package fatcheck runs the external FAT validators (fsck.fat, mtools,
// blkid) against image files for the seed tests. Each check skips the test,
// with the reason, when its tool is not installed; CI installs dosfstools,
// mtools and util-linux so that there they always run.
package fatcheck

import (
	"bytes"
	"fmt"
	"os/exec"
	"regexp"
	"strings"
	"testing"
)

// Need skips t unless every named tool is on PATH.
func Need(t testing.TB, tools ...string) {
	t.Helper()
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (apt-get install dosfstools mtools util-linux): %v", tool, err)
		}
	}
}

// run executes a tool with a fixed environment so that mtools does not read
// a user's configuration or complain about geometry.
func run(tool string, args ...string) (stdout, stderr []byte, err error) {
	cmd := exec.Command(tool, args...)
	cmd.Env = []string{"PATH=/usr/sbin:/usr/bin:/sbin:/bin", "LC_ALL=C", "TZ=UTC", "MTOOLSRC=/dev/null", "HOME=/nonexistent"}
	var o, e bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &e
	err = cmd.Run()
	return o.Bytes(), e.Bytes(), err
}

var (
	fsckSummary = regexp.MustCompile(`^\S+: \d+ files, \d+/\d+ clusters$`)
	fsckBoot    = regexp.MustCompile(`^(System ID ".*"|Media byte 0x[0-9a-f]+ \(hard disk\)|\s+\d+ (bytes per logical sector|bytes per cluster|reserved sectors?|hidden sectors|sectors total|root directory entries|data clusters \(\d+ bytes\)|FATs, (12|16) bit entries|bytes per FAT \(= \d+ sectors?\))|First FAT starts at byte \d+ \(sector \d+\)|Root directory starts at byte \d+ \(sector \d+\)|Data area starts at byte \d+ \(sector \d+\)|\d+ sectors/track, \d+ heads)$`)
)

// Fsck runs `fsck.fat -n -v -V -S -U` and fails t unless it exits 0 and
// prints nothing but its banner, the boot-sector report, "Checking ..."
// lines and the summary: fsck.fat exits 0 on some problems (a wrong long
// name checksum, for one), so the exit code alone proves little. It returns
// the summary line.
func Fsck(t testing.TB, img string) string {
	t.Helper()
	Need(t, "fsck.fat")
	out, errOut, err := run("fsck.fat", "-n", "-v", "-V", "-S", "-U", img)
	all := string(out) + string(errOut)
	if err != nil {
		t.Fatalf("fsck.fat -n %s: %v\n%s", img, err, all)
	}
	summary := ""
	for _, line := range strings.Split(strings.TrimRight(all, "\n"), "\n") {
		switch {
		case strings.HasPrefix(line, "fsck.fat "), strings.HasPrefix(line, "Checking "),
			line == "Boot sector contents:", line == "Starting check/repair pass.", line == "Starting verification pass.":
		case fsckBoot.MatchString(line):
		case fsckSummary.MatchString(line):
			summary = line
		default:
			t.Errorf("fsck.fat -n %s printed an unexpected line %q; full output:\n%s", img, line, all)
		}
	}
	if summary == "" {
		t.Errorf("fsck.fat -n %s: no summary line in\n%s", img, all)
	}
	return summary
}

// Mdir returns the long names `mdir -i img ::` lists (its last column, for
// every entry line that shows a long name), failing t on error.
func Mdir(t testing.TB, img string) (label string, longNames []string) {
	t.Helper()
	Need(t, "mdir")
	out, errOut, err := run("mdir", "-i", img, "::")
	if err != nil {
		t.Fatalf("mdir -i %s: %v\n%s%s", img, err, out, errOut)
	}
	if len(errOut) > 0 {
		t.Errorf("mdir -i %s wrote to stderr: %s", img, errOut)
	}
	// Entry lines: SHORT [EXT] SIZE DATE TIME LONGNAME; the long name may
	// contain spaces, so split on the time column.
	entry := regexp.MustCompile(`^\S+(?: +\S{1,3})? +(?:\d[\d ]*|<DIR>) +\d{4}-\d\d-\d\d +\d{1,2}:\d\d  (.+)$`)
	for _, line := range strings.Split(string(out), "\n") {
		if l, ok := strings.CutPrefix(line, " Volume in drive : is "); ok {
			label = strings.TrimRight(l, " ")
			continue
		}
		if m := entry.FindStringSubmatch(line); m != nil {
			longNames = append(longNames, m[1])
		}
	}
	return label, longNames
}

// Mtype returns the bytes `mtype -i img ::name` prints.
func Mtype(t testing.TB, img, name string) []byte {
	t.Helper()
	Need(t, "mtype")
	out, errOut, err := run("mtype", "-i", img, "::"+name)
	if err != nil || len(errOut) > 0 {
		t.Fatalf("mtype -i %s ::%s: %v\n%s", img, name, err, errOut)
	}
	return out
}

// Blkid returns the `blkid -p -o export` values for img. -p probes the file
// itself, bypassing the cache that remembers stale images.
func Blkid(t testing.TB, img string) map[string]string {
	t.Helper()
	Need(t, "blkid")
	out, errOut, err := run("blkid", "-p", "-o", "export", img)
	if err != nil {
		t.Fatalf("blkid -p %s: %v\n%s%s", img, err, out, errOut)
	}
	kv := make(map[string]string)
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			kv[k] = v
		}
	}
	return kv
}

// FormatVolumeID is how blkid prints a FAT volume ID.
func FormatVolumeID(id uint32) string {
	return fmt.Sprintf("%04X-%04X", id>>16, id&0xFFFF)
}
