// Package kmodtest builds the files package kmod reads, for tests: kernel
// module objects and bzImage headers.
package kmodtest

import (
	"bytes"
	"encoding/binary"
)

// Module builds a minimal ELF64 relocatable object whose .modinfo
// section holds the NUL-terminated strings info, as a .ko does.
func Module(info ...string) []byte {
	var modinfo []byte
	for _, kv := range info {
		modinfo = append(append(modinfo, kv...), 0)
	}
	shstrtab := []byte("\x00.modinfo\x00.shstrtab\x00")
	const ehsize, shentsize = 64, 64
	modinfoOff := uint64(ehsize)
	shstrOff := modinfoOff + uint64(len(modinfo))
	shoff := (shstrOff + uint64(len(shstrtab)) + 7) &^ 7

	var b bytes.Buffer
	le := binary.LittleEndian
	b.Write([]byte{0x7f, 'E', 'L', 'F', 2, 1, 1, 0})
	b.Write(make([]byte, 8))
	binary.Write(&b, le, uint16(1))  // e_type ET_REL
	binary.Write(&b, le, uint16(62)) // e_machine x86-64
	binary.Write(&b, le, uint32(1))  // e_version
	binary.Write(&b, le, uint64(0))  // e_entry
	binary.Write(&b, le, uint64(0))  // e_phoff
	binary.Write(&b, le, shoff)
	binary.Write(&b, le, uint32(0)) // e_flags
	binary.Write(&b, le, uint16(ehsize))
	binary.Write(&b, le, uint16(0)) // e_phentsize
	binary.Write(&b, le, uint16(0)) // e_phnum
	binary.Write(&b, le, uint16(shentsize))
	binary.Write(&b, le, uint16(3)) // e_shnum
	binary.Write(&b, le, uint16(2)) // e_shstrndx
	b.Write(modinfo)
	b.Write(shstrtab)
	b.Write(make([]byte, int(shoff)-b.Len()))
	section := func(name, typ uint32, flags, off, size uint64) {
		binary.Write(&b, le, name)
		binary.Write(&b, le, typ)
		binary.Write(&b, le, flags)
		binary.Write(&b, le, uint64(0)) // sh_addr
		binary.Write(&b, le, off)
		binary.Write(&b, le, size)
		binary.Write(&b, le, uint32(0)) // sh_link
		binary.Write(&b, le, uint32(0)) // sh_info
		binary.Write(&b, le, uint64(1)) // sh_addralign
		binary.Write(&b, le, uint64(0)) // sh_entsize
	}
	section(0, 0, 0, 0, 0)
	section(1, 1, 2, modinfoOff, uint64(len(modinfo))) // PROGBITS, SHF_ALLOC
	section(10, 3, 0, shstrOff, uint64(len(shstrtab))) // STRTAB
	return b.Bytes()
}

// BzImage builds the start of an x86 bzImage: the setup header with
// kernel_version pointing at version.
func BzImage(version string) []byte {
	b := make([]byte, 0x1000)
	copy(b[0x202:], "HdrS")
	binary.LittleEndian.PutUint16(b[0x206:], 0x020f)
	const at = 0x800
	binary.LittleEndian.PutUint16(b[0x20e:], at-0x200)
	copy(b[at:], version+"\x00")
	return b
}
