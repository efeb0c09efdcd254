#include "textflag.h"

// func streamAVX(dst, src *byte, n int)
// n is a multiple of 128, dst 32-byte aligned (Stream's caller sees to
// both). Loads are unaligned; stores non-temporal; SFENCE at the end orders
// them before the caller's later stores.
TEXT ·streamAVX(SB), NOSPLIT, $0-24
	MOVQ	dst+0(FP), DI
	MOVQ	src+8(FP), SI
	MOVQ	n+16(FP), CX
loop:
	CMPQ	CX, $128
	JB	done
	VMOVDQU	0(SI), Y0
	VMOVDQU	32(SI), Y1
	VMOVDQU	64(SI), Y2
	VMOVDQU	96(SI), Y3
	VMOVNTDQ	Y0, 0(DI)
	VMOVNTDQ	Y1, 32(DI)
	VMOVNTDQ	Y2, 64(DI)
	VMOVNTDQ	Y3, 96(DI)
	ADDQ	$128, SI
	ADDQ	$128, DI
	SUBQ	$128, CX
	JMP	loop
done:
	SFENCE
	VZEROUPPER
	RET
