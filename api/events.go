package api

import (
	"context"
	"net/http"

	"vmhost/events"
	"vmhost/store"
)

// streamEvents answers GET /api/events (docs/api.md, Events): the event log as
// Server-Sent Events, resumed after Last-Event-ID (or ?since=), filtered
// by ?vm_id= and ?label= (the labels each event carries). The stream ends when the client goes, the agent shuts down
// (CloseStreams), or the client falls behind what the log keeps.
func (s *Server) streamEvents(w http.ResponseWriter, r *http.Request) {
	if s.events == nil {
		writeError(w, http.StatusInternalServerError, CodeInternal, "this agent keeps no event log")
		return
	}
	since, resume, err := events.ParseResume(r)
	if err != nil {
		writeError(w, http.StatusBadRequest, CodeBadRequest, err.Error())
		return
	}
	vmID := r.URL.Query().Get("vm_id")
	if vmID != "" && !store.ValidID(vmID) {
		writeError(w, http.StatusBadRequest, CodeBadRequest, "vm_id: not a valid VM id")
		return
	}
	sel, ok := labelSelector(w, r)
	if !ok {
		return
	}
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(s.streamsCtx, cancel)
	defer stop()
	if err := s.events.Stream(ctx, w, events.StreamOptions{Since: since, FromStart: resume, VMID: vmID, Labels: sel}); err != nil {
		s.log.Debug("event stream ended", "remote", r.RemoteAddr, "err", err)
	}
}

// CloseStreams ends every event stream, for a graceful shutdown: an open
// stream would otherwise hold http.Server.Shutdown until its deadline.
func (s *Server) CloseStreams() { s.closeStreams() }
