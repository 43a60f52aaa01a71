package api

import (
	"errors"
	"io/fs"
	"net/http"
	"time"

	"vmhost/disk"
	"vmhost/hostpci"
	"vmhost/registry"
	"vmhost/vm"
)

// Host catalogs (docs/api.md, Host catalogs): registry images, host PCI devices,
// the verified image cache, and the balloon.

// registryImage is a RegistryImage: what an index lists, and whether the
// verified image is in the local cache.
type registryImage struct {
	registry.Image
	Cached   bool       `json:"cached"`
	CachedAt *time.Time `json:"cached_at,omitempty"`
}

func (s *Server) registryView(im registry.Image) registryImage {
	v := registryImage{Image: im}
	if s.cache != nil {
		if e, ok := s.cache.Stat(im.ContentSHA256); ok {
			v.Cached, v.CachedAt = true, &e.CachedAt
		}
	}
	return v
}

func (s *Server) registryImages() []registry.Image {
	if s.registry == nil {
		return nil
	}
	return s.registry.List()
}

// registryList, pciList and cacheList are the catalogs' list bodies.
type (
	registryList struct {
		Images []registryImage `json:"images"`
	}
	pciList struct {
		Devices []pciDevice `json:"devices"`
	}
	cacheList struct {
		Images []cachedImage `json:"images"`
	}
)

// listRegistryImages answers GET /api/registry/images, sorted by image_id.
func (s *Server) listRegistryImages(w http.ResponseWriter, r *http.Request) {
	images := s.registryImages()
	out := make([]registryImage, 0, len(images))
	for _, im := range images {
		out = append(out, s.registryView(im))
	}
	writeJSON(w, http.StatusOK, registryList{out})
}

// getRegistryImage answers GET /api/registry/images/{id}.
func (s *Server) getRegistryImage(w http.ResponseWriter, r *http.Request) {
	if s.registry != nil {
		if im, ok := s.registry.Get(r.PathValue("id")); ok {
			writeJSON(w, http.StatusOK, s.registryView(im))
			return
		}
	}
	writeError(w, http.StatusNotFound, CodeNotFound, "no registry index lists an image with this id")
}

// pciDevice is a PciDevice: sysfs's view, and the VM whose pci_devices
// holds it.
type pciDevice struct {
	hostpci.Device
	ClaimedBy string `json:"claimed_by,omitempty"`
}

// listHostPCI answers GET /api/host/pci, in BDF order.
func (s *Server) listHostPCI(w http.ResponseWriter, r *http.Request) {
	devs, err := hostpci.List(s.vms.Config().SysfsRoot, s.pciIDs)
	if err != nil {
		s.fail(w, r, &vm.HostError{Kind: vm.HostInternal, Op: "listing host PCI devices", Err: err})
		return
	}
	claims := map[string]string{}
	for _, mode := range []vm.Mode{vm.ModeVM, vm.ModeAppVM} {
		for _, rec := range s.vms.List(mode) {
			for _, bdf := range rec.Spec.PCIDevices {
				claims[bdf] = rec.ID
			}
		}
	}
	out := make([]pciDevice, 0, len(devs))
	for _, d := range devs {
		out = append(out, pciDevice{Device: d, ClaimedBy: claims[d.BDF]})
	}
	writeJSON(w, http.StatusOK, pciList{out})
}

// cachedImage is one entry of GET /api/images/cache.
type cachedImage struct {
	Digest     string    `json:"digest"`
	SizeBytes  int64     `json:"size_bytes"`
	CachedAt   time.Time `json:"cached_at"`
	LastUsedAt time.Time `json:"last_used_at"`
	InUse      bool      `json:"in_use"`
	// RegistryImageIDs are the registry images whose content this is.
	RegistryImageIDs []string `json:"registry_image_ids"`
}

// listImageCache answers GET /api/images/cache, most recently used first.
func (s *Server) listImageCache(w http.ResponseWriter, r *http.Request) {
	out := []cachedImage{}
	if s.cache != nil {
		ents, err := s.cache.List()
		if err != nil {
			s.fail(w, r, &vm.HostError{Kind: vm.HostStorage, Op: "listing the image cache", Err: err})
			return
		}
		ids := map[string][]string{}
		for _, im := range s.registryImages() {
			ids[im.ContentSHA256] = append(ids[im.ContentSHA256], im.ImageID)
		}
		for _, e := range ents {
			refs := ids[e.Digest]
			if refs == nil {
				refs = []string{}
			}
			out = append(out, cachedImage{Digest: e.Digest, SizeBytes: e.SizeBytes, CachedAt: e.CachedAt,
				LastUsedAt: e.LastUsedAt, InUse: e.InUse, RegistryImageIDs: refs})
		}
	}
	writeJSON(w, http.StatusOK, cacheList{out})
}

// deleteImageCache answers DELETE /api/images/cache/{digest}: 204, 404 when
// not cached, 409 CONFLICT while a provision uses or downloads it.
func (s *Server) deleteImageCache(w http.ResponseWriter, r *http.Request) {
	var err error = fs.ErrNotExist
	if s.cache != nil {
		err = s.cache.Delete(r.PathValue("digest"))
	}
	switch {
	case err == nil:
		w.WriteHeader(http.StatusNoContent)
	case errors.Is(err, disk.ErrImageInUse):
		writeError(w, http.StatusConflict, CodeConflict, "the cached image is in use by a provision; delete it once the VM is created")
	case errors.Is(err, fs.ErrNotExist):
		writeError(w, http.StatusNotFound, CodeNotFound, "no cached image has this digest")
	default:
		s.fail(w, r, &vm.HostError{Kind: vm.HostStorage, Op: "deleting a cached image", Err: err})
	}
}

// balloonRequest is the body of POST /api/vms/{id}/balloon.
type balloonRequest struct {
	BalloonMB uint64 `json:"balloon_mb" decode:"required"`
}

// setBalloon returns the balloon handler of family mode: 204 once the
// running VM's balloon changed, or the target is recorded for a VM that
// does not run.
func setBalloon(mode vm.Mode) func(*Server, http.ResponseWriter, *http.Request) {
	return func(s *Server, w http.ResponseWriter, r *http.Request) {
		var req balloonRequest
		if _, ok := s.decodeBody(w, r, MaxBodyBytes, &req); !ok {
			return
		}
		if _, err := s.vms.SetBalloon(r.Context(), mode, r.PathValue("id"), req.BalloonMB); err != nil {
			s.lifecycleFail(w, r, mode, err)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}
}
