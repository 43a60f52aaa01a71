package jail

// SetProgramPath makes what starts keep of host path p a link to target,
// as if p had been one when an earlier start looked.
func SetProgramPath(p, target string) {
	programPaths.Lock()
	programPaths.m[p] = hostEntry{link: target, isLink: true}
	programPaths.Unlock()
}

// KeptProgramPath says what starts keep of host path p: whether they keep
// anything, and the link it is, if one.
func KeptProgramPath(p string) (kept bool, link string) {
	programPaths.Lock()
	defer programPaths.Unlock()
	e, ok := programPaths.m[p]
	return ok, e.link
}
