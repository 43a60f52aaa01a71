package api

import (
	"errors"
	"io/fs"
	"net/http"

	"vmhost/appvm"
)

// imageList is the body of GET /api/appvm/images (docs/design.md §5).
type imageList struct {
	Images []*appvm.Image `json:"images"`
}

// listImages answers every catalog entry; an entry whose image.json cannot
// be read is logged and left out rather than failing the whole list.
func (s *Server) listImages(w http.ResponseWriter, r *http.Request) {
	imgs, err := s.images.Catalog().List()
	if err != nil {
		s.log.Error("reading the AppVM image catalog", "err", err)
	}
	out := imageList{Images: []*appvm.Image{}}
	out.Images = append(out.Images, imgs...)
	writeJSON(w, http.StatusOK, out)
}

func (s *Server) getImage(w http.ResponseWriter, r *http.Request) {
	img, err := s.images.Catalog().Get(r.PathValue("id"))
	if errors.Is(err, fs.ErrNotExist) {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM image has this id")
		return
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusOK, img)
}

// importImage starts a background import and answers 202 with the entry
// (status importing, or a ready entry with reimport importing); the caller
// polls GET /api/appvm/images/{id}.
func (s *Server) importImage(w http.ResponseWriter, r *http.Request) {
	var req appvm.ImportRequest
	if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
		return
	}
	noteID(r, req.ID)
	img, err := s.images.Start(&req)
	if err != nil {
		s.fail(w, r, err)
		return
	}
	writeJSON(w, http.StatusAccepted, img)
}

// deleteImage removes an image that no AppVM uses and no import holds.
func (s *Server) deleteImage(w http.ResponseWriter, r *http.Request) {
	err := s.apps.DeleteImage(s.images, r.PathValue("id"))
	if errors.Is(err, fs.ErrNotExist) {
		writeError(w, http.StatusNotFound, CodeNotFound, "no AppVM image has this id")
		return
	}
	if err != nil {
		s.fail(w, r, err)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
