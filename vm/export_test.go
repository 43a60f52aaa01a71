package vm

// WaitersOf is how many requests wait on VM id (wait.go).
func (s *Service) WaitersOf(id string) int { return s.changes.waiting(id) }
